"""Fixtures for the local backend: one real emulated TPU cluster per test module.

Real Ray processes, no mocks. The machine is small and shared, so every module that
needs a cluster reuses one (module scope) and each Ray node is kept small (1 CPU, a
150 MB object store).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.backends.settings import ConnectionSettings
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import ClusterStatus
from airflow_provider_raytpu.tpu import TpuSlice

CLUSTER_READY_TIMEOUT = 150.0

TPU_LABELS = {
    "ray.io/tpu-slice-name": "emu-slice-0",
    "ray.io/tpu-topology": "2x2x2",
    "ray.io/tpu-pod-type": "v4-16",
    "ray.io/accelerator-type": "TPU-V4",
}


@dataclass(frozen=True)
class EmulatedCluster:
    """The module's cluster: its manifest and how it was applied."""

    name: str
    namespace: str
    manifest: dict[str, Any]
    action: str


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


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def watch_until(
    backend: LocalBackend, name: str, namespace: str, until: Callable[[ClusterStatus], bool], timeout: float
) -> list[ClusterStatus]:
    """Every status ``watch_cluster`` yields, up to and including the first that satisfies ``until``."""
    seen: list[ClusterStatus] = []
    async with asyncio.timeout(timeout):
        async with contextlib.aclosing(backend.watch_cluster(name, namespace)) as statuses:
            async for status in statuses:
                seen.append(status)
                if until(status):
                    return seen
    raise AssertionError(f"watch ended without the awaited status; saw {seen}")


def run_driver(gcs_address: str, body: str, timeout: float = 120.0) -> Any:
    """Run ``body`` in a fresh Python connected with ``ray.init(address=gcs_address)``; return its ``RESULT`` JSON.

    ``body`` sets a variable ``result``; a subprocess keeps this test process free of a Ray driver.
    """
    code = (
        "import json, ray\n"
        f"ray.init(address={gcs_address!r}, logging_level='ERROR', log_to_driver=False)\n"
        f"{body}\n"
        "print('RESULT ' + json.dumps(result))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])
