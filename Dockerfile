# pdx and the engine simulator in one small image.
#
#   docker build -t pdx .
#   docker run --rm -v $PWD/deploy/pdx.yaml:/etc/pdx/pdx.yaml:ro pdx
#
# deploy/docker-compose.yaml builds it and runs it as pdx and as the four
# simulated engines (entrypoint /pdx-engine-sim).

# ---- build ----
FROM golang:1.26.8-bookworm AS build
WORKDIR /src
ENV CGO_ENABLED=0 GOFLAGS=-mod=readonly
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN go build -trimpath -tags vtprotobuf -ldflags='-s -w' -o /out/pdx ./cmd/pdx && \
    go build -trimpath -ldflags='-s -w' -o /out/pdx-engine-sim ./cmd/pdx-engine-sim

# ---- run ----
# Static binaries on distroless: no shell, no package manager, CA
# certificates and /etc/passwd for the nonroot user (uid/gid 65532).
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/pdx /out/pdx-engine-sim /
COPY deploy/pdx.yaml /etc/pdx/pdx.yaml
USER 65532:65532
# 9002: ext_proc gRPC (for Envoy); 9003: admin (/healthz, /readyz).
EXPOSE 9002 9003
ENTRYPOINT ["/pdx"]
CMD ["serve", "--config", "/etc/pdx/pdx.yaml"]
