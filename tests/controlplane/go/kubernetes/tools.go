//go:build tools

// Blank imports keep the commands' dependencies in go.mod/go.sum under
// `go mod tidy`; build_binaries.sh builds them with `go build -o`.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
