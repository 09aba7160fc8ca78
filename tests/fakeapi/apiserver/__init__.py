"""Tests of the fake Kubernetes API server and fake KubeRay operator themselves."""
