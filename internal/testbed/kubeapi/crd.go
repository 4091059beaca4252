package kubeapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

// CRDResource is the API of CustomResourceDefinitions.
var CRDResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// ApplyCRD creates the CustomResourceDefinition crd, or replaces the one of
// its name, and waits until the API server has established it and serves
// its resources. A changed schema may apply to requests a moment later.
func (s *Server) ApplyCRD(ctx context.Context, crd *unstructured.Unstructured) error {
	client, err := dynamic.NewForConfig(s.Config())
	if err != nil {
		return err
	}
	crds := client.Resource(CRDResource)
	crd = crd.DeepCopy()
	existing, err := crds.Get(ctx, crd.GetName(), metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = crds.Create(ctx, crd, metav1.CreateOptions{})
	case err == nil:
		crd.SetResourceVersion(existing.GetResourceVersion())
		_, err = crds.Update(ctx, crd, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("CRD %s: %w", crd.GetName(), err)
	}
	err = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		got, err := crds.Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
		for _, c := range conds {
			if c, ok := c.(map[string]any); ok && c["type"] == "Established" && c["status"] == "True" {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("CRD %s not established: %w", crd.GetName(), err)
	}
	// Established, the resources may take a moment more to be served.
	for _, gvr := range CRDResources(crd) {
		err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			_, err := client.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1})
			return err == nil, nil
		})
		if err != nil {
			return fmt.Errorf("%s not served: %w", gvr, err)
		}
	}
	return nil
}

// DeleteCRD deletes the CustomResourceDefinition name, and with it every
// object of its resources, and waits until it is gone.
func (s *Server) DeleteCRD(ctx context.Context, name string) error {
	client, err := dynamic.NewForConfig(s.Config())
	if err != nil {
		return err
	}
	crds := client.Resource(CRDResource)
	if err := crds.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	return wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := crds.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
}

// CRDResources are the resources a CustomResourceDefinition serves, one
// per served version.
func CRDResources(crd *unstructured.Unstructured) []schema.GroupVersionResource {
	group, _, _ := unstructured.NestedString(crd.Object, "spec", "group")
	plural, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "plural")
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	var out []schema.GroupVersionResource
	for _, v := range versions {
		v, _ := v.(map[string]any)
		if name, _ := v["name"].(string); name != "" && v["served"] == true {
			out = append(out, schema.GroupVersionResource{Group: group, Version: name, Resource: plural})
		}
	}
	return out
}

// The CustomResourceDefinitions of InferenceCRDs, by name.
const (
	InferencePoolCRD = "inferencepools.inference.networking.k8s.io"
	// The Gateway API Inference Extension's InferenceObjective.
	GIEObjectiveCRD = "inferenceobjectives.inference.networking.x-k8s.io"
	// llm-d's InferenceObjective.
	LLMDObjectiveCRD = "inferenceobjectives.llm-d.ai"
)

// InferenceCRDs are the CustomResourceDefinitions pdx's manifests and
// watchers use: the InferencePool and the InferenceObjective of the Gateway
// API Inference Extension, as its Go module at go.mod's version ships them,
// and llm-d's InferenceObjective, which is the same v1alpha2 schema in the
// llm-d.ai group (its poolRef's group defaulting to llm-d.ai).
func InferenceCRDs(ctx context.Context) ([]*unstructured.Unstructured, error) {
	crds, err := ModuleCRDs(ctx, "sigs.k8s.io/gateway-api-inference-extension",
		"config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
		"config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml")
	if err != nil {
		return nil, err
	}
	llmd, err := regroup(crds[1], "llm-d.ai")
	if err != nil {
		return nil, err
	}
	return append(crds, llmd), nil
}

// GatewayCRDs are the Gateway API's GatewayClass, Gateway and HTTPRoute
// (its standard channel), as its Go module at go.mod's version ships them.
func GatewayCRDs(ctx context.Context) ([]*unstructured.Unstructured, error) {
	return ModuleCRDs(ctx, "sigs.k8s.io/gateway-api",
		"config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
		"config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
		"config/crd/standard/gateway.networking.k8s.io_httproutes.yaml")
}

// ModuleCRDs reads CustomResourceDefinitions from files of a Go module, at
// the version the main module requires: the CRDs generated from the API
// types pdx builds with.
func ModuleCRDs(ctx context.Context, module string, files ...string) ([]*unstructured.Unstructured, error) {
	dir, err := moduleDir(ctx, module)
	if err != nil {
		return nil, err
	}
	var crds []*unstructured.Unstructured
	for _, file := range files {
		data, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(file)))
		if err != nil {
			return nil, err
		}
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(data, &u.Object); err != nil {
			return nil, fmt.Errorf("%s %s: %w", module, file, err)
		}
		if u.GetKind() != "CustomResourceDefinition" {
			return nil, fmt.Errorf("%s %s: a %s, not a CustomResourceDefinition", module, file, u.GetKind())
		}
		crds = append(crds, u)
	}
	return crds, nil
}

// regroup returns crd with its resources in group.
func regroup(crd *unstructured.Unstructured, group string) (*unstructured.Unstructured, error) {
	out := crd.DeepCopy()
	plural, _, _ := unstructured.NestedString(out.Object, "spec", "names", "plural")
	out.SetName(plural + "." + group)
	out.SetAnnotations(nil)
	if err := unstructured.SetNestedField(out.Object, group, "spec", "group"); err != nil {
		return nil, err
	}
	versions, _, _ := unstructured.NestedSlice(out.Object, "spec", "versions")
	for _, v := range versions {
		v, _ := v.(map[string]any)
		path := []string{"schema", "openAPIV3Schema", "properties", "spec", "properties", "poolRef", "properties", "group"}
		if _, found, _ := unstructured.NestedMap(v, path...); !found {
			return nil, fmt.Errorf("CRD %s: no spec.poolRef.group in its schema", crd.GetName())
		}
		if err := unstructured.SetNestedField(v, group, append(path, "default")...); err != nil {
			return nil, err
		}
	}
	if err := unstructured.SetNestedSlice(out.Object, versions, "spec", "versions"); err != nil {
		return nil, err
	}
	return out, nil
}

// moduleDir is the folder of module, at the version the main module
// requires, downloaded if it is not yet.
func moduleDir(ctx context.Context, module string) (string, error) {
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", module)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var m struct{ Dir, Error string }
	if jerr := json.Unmarshal(out, &m); jerr != nil || m.Dir == "" {
		return "", fmt.Errorf("go mod download %s: %v %s %s", module, err, m.Error, stderr.String())
	}
	return m.Dir, nil
}
