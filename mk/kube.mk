# A real Kubernetes API server and etcd for the tests that watch a cluster
# (internal/testbed/kubeapi starts them). Included by the top-level Makefile.
#
# Neither has a package this machine can install: both are built from the Go
# module proxy by the scratch modules in mk/kube/ (their go.mod and go.sum
# pin every dependency), into $(KUBE_DIR). A binary already there at the
# version its module names is kept. From scratch (empty module and build
# caches) the pair costs ~10 minutes of CPU (586 s measured, so ~5 minutes on 2
# idle cores) and ~700 MB of modules, the API server nearly all of it.
#
# To move to another Kubernetes release: in mk/kube/apiserver/go.mod set
# k8s.io/kubernetes and every staging module's replace to the release (the
# replace list is k8s.io/kubernetes's own require list of v0.0.0 modules), in
# mk/kube/etcd/go.mod the etcd that release's build/dependencies.yaml names,
# and run `go mod tidy` in both. The kubeapi tests fail when the API server's
# minor version is not client-go's.

GO ?= go
TOOLS ?= $(CURDIR)/.tools
KUBE_DIR ?= $(TOOLS)/kube
export KUBE_DIR

KUBE_VERSION := $(shell awk '$$1 == "k8s.io/kubernetes" {print $$2}' mk/kube/apiserver/go.mod)
ETCD_VERSION := $(shell awk '$$1 == "go.etcd.io/etcd/server/v3" {print $$2}' mk/kube/etcd/go.mod)
kube_semver := $(subst ., ,$(KUBE_VERSION:v%=%))
# What `kube-apiserver --version` and the server's /version report; clients
# (kubectl) refuse a server whose version they cannot parse.
KUBE_LDFLAGS := -s -w $(foreach pkg,k8s.io/component-base/version k8s.io/client-go/pkg/version, \
	-X $(pkg).gitVersion=$(KUBE_VERSION) -X $(pkg).gitMajor=$(word 1,$(kube_semver)) \
	-X $(pkg).gitMinor=$(word 2,$(kube_semver)) -X $(pkg).gitTreeState=clean)

# Static, reproducible binaries; the project's GOFLAGS (its build tag) are
# not theirs.
KUBE_GO := CGO_ENABLED=0 GOFLAGS= $(GO)

.PHONY: kube

## kube: build kube-apiserver and etcd into $(KUBE_DIR) (skipped when there).
kube:
	@mkdir -p "$(abspath $(KUBE_DIR))"
	@if [ "$$("$(KUBE_DIR)/kube-apiserver" --version 2>/dev/null)" != "Kubernetes $(KUBE_VERSION)" ]; then \
	  echo "building kube-apiserver $(KUBE_VERSION) into $(KUBE_DIR) (minutes)"; \
	  $(KUBE_GO) -C mk/kube/apiserver build -trimpath -buildvcs=false -ldflags "$(KUBE_LDFLAGS)" \
	    -o "$(abspath $(KUBE_DIR))/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver && \
	  mv "$(KUBE_DIR)/kube-apiserver.tmp" "$(KUBE_DIR)/kube-apiserver"; \
	fi
	@if [ "$$("$(KUBE_DIR)/etcd" --version 2>/dev/null | head -n 1)" != "etcd Version: $(ETCD_VERSION:v%=%)" ]; then \
	  echo "building etcd $(ETCD_VERSION) into $(KUBE_DIR)"; \
	  $(KUBE_GO) -C mk/kube/etcd build -trimpath -buildvcs=false -ldflags "-s -w" \
	    -o "$(abspath $(KUBE_DIR))/etcd.tmp" go.etcd.io/etcd/server/v3 && \
	  mv "$(KUBE_DIR)/etcd.tmp" "$(KUBE_DIR)/etcd"; \
	fi
