"""What the local backend's tests share besides fixtures: the emulated cluster's record, its labels, waits and a
driver in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.status import ClusterStatus

# A cluster's hosts start one at a time on two cores (the backend's staggered starts); beside the other Ray
# tier, CI's one-slice cluster (a head and two hosts) was not READY within 150 s.
CLUSTER_READY_TIMEOUT = 300.0

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
    try:
        async with asyncio.timeout(timeout):
            async with contextlib.aclosing(backend.watch_cluster(name, namespace)) as statuses:
                async for status in statuses:
                    seen.append(status)
                    if until(status):
                        return seen
    except TimeoutError:
        last = seen[-1] if seen else None
        raise AssertionError(f"{namespace}/{name}: not there within {timeout:.0f} s; its last status: {last}") from None
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
