"""A fake Kubernetes API server over real HTTP, and a reactor that plays the KubeRay operator."""

from .kuberay import KubeRayReactor
from .server import ApiError, ChangeEvent, FakeKubeApiServer, LoggedRequest

__all__ = ["ApiError", "ChangeEvent", "FakeKubeApiServer", "KubeRayReactor", "LoggedRequest"]
