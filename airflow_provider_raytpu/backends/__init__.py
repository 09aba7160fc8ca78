"""Where Ray clusters live: KubeRay on Kubernetes/GKE, or the local emulator."""
