"""Fixtures for the local backend: one real emulated TPU cluster per test module.

Real Ray processes, no mocks. The machine is small and shared, so every module that
needs a cluster reuses one (module scope) and each Ray node is kept small (1 CPU, a
150 MB object store).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import EmulatedCluster


@pytest.fixture(scope="module")
def raytpu_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ``RAYTPU_HOME`` for the module."""
    home = tmp_path_factory.mktemp("raytpu-home")
    patch = pytest.MonkeyPatch()
    patch.setenv("RAYTPU_HOME", str(home))
    patch.delenv("RAY_ADDRESS", raising=False)
    yield home
    patch.undo()


@pytest.fixture(scope="module")
def local_backend(raytpu_home: Path) -> LocalBackend:
    settings = ConnectionSettings.from_extra("raytpu_default", {"backend": "local", "local_home": str(raytpu_home)})
    return LocalBackend(settings)


@pytest.fixture(scope="module")
def emulated_cluster(local_backend: LocalBackend) -> Iterator[EmulatedCluster]:
    """ONE emulated v4 2x2x2 slice (2 hosts x 4 chips), applied once for the module, deleted after it."""
    manifest = build_ray_cluster(name="emu", namespace="default", tpu=TpuSlice("v4", "2x2x2"))
    result = local_backend.apply_cluster(manifest)
    cluster = EmulatedCluster("emu", "default", manifest, result.action.value)
    yield cluster
    local_backend.delete_cluster(cluster.name, cluster.namespace)


@pytest.fixture(scope="module")
def a_ray_token_in_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module that asks for it (``usefixtures``) runs as a user whose ``~/.ray/auth_token`` a
    plain ``ray.init()`` left behind.

    With ``RAY_AUTH_MODE`` unset, every Ray process that finds that file switches to token
    authentication; the local backend's clusters must still come up and serve jobs.
    """
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    patch = pytest.MonkeyPatch()
    patch.setenv("HOME", str(home))
    patch.delenv("RAY_AUTH_MODE", raising=False)
    yield home
    patch.undo()
