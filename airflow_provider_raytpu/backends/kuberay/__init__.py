"""The ``kubernetes`` and ``gke`` backends: RayClusters and RayServices as KubeRay custom resources."""

from airflow_provider_raytpu.backends.kuberay.backend import KubeRayBackend

__all__ = ["KubeRayBackend"]
