package kubeapi

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
)

// Package is the one Server of a test package, started by the first test
// that asks for it, with the package's CRDs installed, and stopped after
// the last test:
//
//	var cluster kubeapi.Package
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(cluster.Wrap(m)) }
//
// Tests that need no cluster run without starting one.
type Package struct {
	// CRDs returns the CustomResourceDefinitions to install before the
	// first test uses the server (InferenceCRDs, say). nil: none.
	CRDs func(context.Context) ([]*unstructured.Unstructured, error)

	once sync.Once
	srv  *Server
	err  error
}

// Server returns the package's server, starting it on the first call; it
// fails t if the server cannot start (its error names `make kube` when the
// binaries are missing).
func (p *Package) Server(t testing.TB) *Server {
	t.Helper()
	p.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if p.srv, p.err = Start(ctx); p.err != nil {
			return
		}
		if p.CRDs == nil {
			return
		}
		crds, err := p.CRDs(ctx)
		for _, crd := range crds {
			if err == nil {
				err = p.srv.ApplyCRD(ctx, crd)
			}
		}
		if err != nil {
			p.err = fmt.Errorf("installing the CRDs: %w\n%s", err, p.srv.Log())
			p.srv.Stop()
			p.srv = nil
		}
	})
	if p.err != nil {
		t.Fatalf("a real Kubernetes API server for this test: %v", p.err)
	}
	return p.srv
}

// Wrap returns m with Run stopping the server, if a test started it, after
// the tests (printing the end of its log if one failed): for
// goleak.VerifyTestMain, or to call Run on.
func (p *Package) Wrap(m *testing.M) interface{ Run() int } {
	return wrapped{m, p}
}

type wrapped struct {
	m *testing.M
	p *Package
}

func (w wrapped) Run() int {
	code := w.m.Run()
	if w.p.srv != nil {
		if code != 0 {
			fmt.Fprint(os.Stderr, w.p.srv.Log())
		}
		w.p.srv.Stop()
	}
	return code
}

// Namespace creates a namespace for t alone and returns its name. It is
// not deleted: without a namespace controller it would stay Terminating,
// and the server goes with the package's tests.
func (s *Server) Namespace(t testing.TB) string {
	t.Helper()
	client, err := kubernetes.NewForConfig(s.Config())
	if err != nil {
		t.Fatal(err)
	}
	ns, err := client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "test-"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating a namespace: %v", err)
	}
	return ns.Name
}
