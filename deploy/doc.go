// Package deploy holds no code: its directory has the container deployment
// of pdx (docker-compose.yaml, the Envoy bootstrap rendered for it, pdx's
// config for it, the example pdx.yaml), and its tests check those files
// against the Envoy template, the Makefile's Envoy version, pdx's config
// loader and each other, without a Docker engine. The Kubernetes manifests
// and their tests are in deploy/kubernetes.
package deploy
