# Protobuf tooling and code generation. Included by the top-level Makefile.
#
# The generated *.pb.go files are committed, so a plain `go build` never needs
# these tools; they are only needed to change api/**/*.proto.

GO ?= go
TOOLS ?= $(CURDIR)/.tools
TOOLS_BIN := $(TOOLS)/bin

BUF_VERSION ?= v1.75.0
# Keep in step with google.golang.org/protobuf in go.mod: generated code must
# not be newer than the runtime it is compiled against.
PROTOC_GEN_GO_VERSION ?= v1.36.12

BUF := $(TOOLS_BIN)/buf
PROTOC_GEN_GO := $(TOOLS_BIN)/protoc-gen-go

# buf.gen.yaml names the plugin "protoc-gen-go" and buf resolves it on PATH,
# so put our pinned copy first.
PROTO_ENV := PATH="$(TOOLS_BIN):$$PATH"

.PHONY: proto-tools generate proto-lint proto-check

## proto-tools: install the pinned buf and protoc-gen-go into $(TOOLS)/bin.
# Installs each tool unless the pinned version is already there, so a version
# bump above reinstalls without having to delete .tools by hand.
proto-tools:
	@test "$$($(BUF) --version 2>/dev/null)" = "$(BUF_VERSION:v%=%)" || \
		{ echo "installing buf $(BUF_VERSION)"; \
		  GOBIN="$(TOOLS_BIN)" $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION); }
	@test "$$($(PROTOC_GEN_GO) --version 2>/dev/null)" = "protoc-gen-go $(PROTOC_GEN_GO_VERSION)" || \
		{ echo "installing protoc-gen-go $(PROTOC_GEN_GO_VERSION)"; \
		  GOBIN="$(TOOLS_BIN)" $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION); }

## generate: regenerate the committed *.pb.go files next to their .proto sources.
generate: proto-tools
	$(PROTO_ENV) $(BUF) generate

## proto-lint: buf lint the protobuf API.
proto-lint: proto-tools
	$(BUF) lint

## proto-check: proto-lint, and fail if the committed generated code is stale
## (e.g. a .proto was edited without `make generate`).
proto-check: proto-lint
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PROTO_ENV) $(BUF) generate --output "$$tmp" && \
	{ diff -r --exclude='*.proto' api "$$tmp/api" || \
	  { echo "generated code under api/ is stale: run 'make generate'" >&2; exit 1; }; }
