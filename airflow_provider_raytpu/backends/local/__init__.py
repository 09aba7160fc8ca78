"""The ``local`` backend: RayClusters and RayServices as Ray processes on this machine, with emulated TPU slices."""

from airflow_provider_raytpu.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
