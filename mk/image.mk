# pdx's OCI image, built without a container engine. Included by the
# top-level Makefile.
#
# cmd/pdx-image compiles pdx and the engine simulator (static, -trimpath)
# for each platform and puts them, with deploy/pdx.yaml, on a base layer of
# the few files a static binary needs (/etc/passwd with the nonroot user
# 65532, CA certificates, /tmp), or on IMAGE_BASE pulled from its registry;
# it writes an OCI image layout archive that docker load, podman load,
# skopeo and crane read, and pushes it. Every timestamp is
# SOURCE_DATE_EPOCH (by default the commit time of HEAD): one commit, one
# image digest.

# The project's image reference (deploy/kubernetes and the chart name it);
# the tag is the chart's appVersion.
IMAGE_REPOSITORY ?= ghcr.io/pdx-router/pdx
IMAGE_VERSION ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' deploy/helm/pdx/Chart.yaml)
# Comma-separated; two or more make an image index (pushed whole; docker
# load takes single-platform archives).
IMAGE_PLATFORMS ?= linux/$(shell $(GO) env GOARCH)
# Empty: the scratch base. E.g. gcr.io/distroless/static-debian12:nonroot
# where that registry is reachable.
IMAGE_BASE ?=
IMAGE_ARCHIVE ?= bin/pdx-$(IMAGE_VERSION).oci.tar
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null)

.PHONY: image image-push

## image: build pdx's image into $(IMAGE_ARCHIVE), named
## $(IMAGE_REPOSITORY):$(IMAGE_VERSION); load it with docker load -i or
## podman load -i, or push it with make image-push.
image:
	SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(GO) run ./cmd/pdx-image build --out "$(IMAGE_ARCHIVE)" --repository "$(IMAGE_REPOSITORY)" \
	  --version "$(IMAGE_VERSION)" --platform "$(IMAGE_PLATFORMS)" $(if $(IMAGE_BASE),--base "$(IMAGE_BASE)")

## image-push: build it and push it to $(IMAGE_REPOSITORY):$(IMAGE_VERSION),
## as docker login, podman login or crane auth login logged you in.
image-push: image
	$(GO) run ./cmd/pdx-image push "$(IMAGE_ARCHIVE)" "$(IMAGE_REPOSITORY):$(IMAGE_VERSION)"
