package mainlib

import (
	"fmt"
	"log/slog"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// kubeClient makes the Kubernetes client of pools that discover their
// engines: from the kubeconfig file when one is given, else from the pod's
// service account. pdx calls it only when a config has such a pool.
func kubeClient(kubeconfig string, log *slog.Logger) func() (kubernetes.Interface, error) {
	return func() (kubernetes.Interface, error) {
		cfg, err := restConfig(kubeconfig, log)
		if err != nil {
			return nil, err
		}
		return kubernetes.NewForConfig(cfg) // reload names the client in errors
	}
}

// dynamicClient makes the client that watches InferenceObjectives, which
// client-go has no typed client for; pdx calls it only when a pool learns
// its objectives from the cluster.
func dynamicClient(kubeconfig string, log *slog.Logger) func() (dynamic.Interface, error) {
	return func() (dynamic.Interface, error) {
		cfg, err := restConfig(kubeconfig, log)
		if err != nil {
			return nil, err
		}
		return dynamic.NewForConfig(cfg)
	}
}

func restConfig(kubeconfig string, log *slog.Logger) (*rest.Config, error) {
	// client-go logs (a watch that fails, say) through klog: into pdx's
	// log rather than klog's own stderr format.
	klog.SetSlogLogger(log)
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
	} else if cfg, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("%w (outside a cluster, pass --kubeconfig)", err)
	}
	cfg.UserAgent = "pdx"
	return cfg, nil
}
