"""A real Kubernetes control plane (etcd, kube-apiserver, scheduler, controller manager, KubeRay) for tests."""
