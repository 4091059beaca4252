# The official OpenAI and Anthropic Python clients, pinned, pip-installed
# with their dependencies into .tools/pyclients: e2e's TestPythonClients
# runs their ordinary calls (responses.create, responses.stream,
# messages.create, messages.stream) through Envoy and pdx. Included by the
# top-level Makefile. PYCLIENTS_DIR overrides where they are.

OPENAI_PY_VERSION := 3.51.0
ANTHROPIC_PY_VERSION := 2.10.0
PYCLIENTS_DIR ?= $(TOOLS)/pyclients
export PYCLIENTS_DIR

.PHONY: pyclients

## pyclients: install the pinned OpenAI and Anthropic Python clients.
pyclients:
	@if [ "$$(cat "$(PYCLIENTS_DIR)/.pinned" 2>/dev/null)" != "openai==$(OPENAI_PY_VERSION) anthropic==$(ANTHROPIC_PY_VERSION)" ]; then \
	  echo "installing openai==$(OPENAI_PY_VERSION) anthropic==$(ANTHROPIC_PY_VERSION) into $(PYCLIENTS_DIR)"; \
	  rm -rf "$(PYCLIENTS_DIR)"; \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --target "$(PYCLIENTS_DIR)" "openai==$(OPENAI_PY_VERSION)" "anthropic==$(ANTHROPIC_PY_VERSION)" && \
	  echo "openai==$(OPENAI_PY_VERSION) anthropic==$(ANTHROPIC_PY_VERSION)" > "$(PYCLIENTS_DIR)/.pinned"; \
	fi
