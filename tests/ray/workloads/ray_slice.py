"""An emulated TPU slice on one machine: a Ray head plus one raylet per TPU host.

Each host raylet gets what a GKE TPU host gets from KubeRay and the GKE Ray add-on -
the ``TPU`` resource, ``accelerator_type:TPU-V4``, ``TPU-<pod type>-head`` on host 0,
the ``ray.io/tpu-*`` node labels and the ``TPU_*`` environment - with JAX on the CPU.
Ray's slice reservation and JaxTrainer then run for real on it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.tpu import TpuSlice

if TYPE_CHECKING:
    from tests.support.gcs import GcsStorage

OBJECT_STORE_BYTES = 150 * 1024 * 1024
REPO = Path(__file__).resolve().parents[3]
SLICE = TpuSlice("v4", "2x2x2")  # 8 chips = 2 hosts of 4


class EmulatedSlice:
    """One TPU slice of ``tpu``'s shape as a local Ray cluster (head + one node per host).

    :param tpu: the slice shape; one Ray node per host.
    :param name: the slice name (``TPU_NAME``, ``ray.io/tpu-slice-name`` and a resource).
    :param env: extra environment for every node's workers (e.g. the GCS emulator's).
    """

    def __init__(self, tpu: TpuSlice, name: str = "slice-a", env: dict[str, str] | None = None) -> None:
        self.tpu = tpu
        self.name = name
        self.env = dict(env or {})
        self.cluster: Any = None
        self.hosts: dict[int, Any] = {}
        self.temp_dir = ""
        self._saved_environ: dict[str, str | None] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    def host_args(self, worker_id: int) -> dict[str, Any]:
        """``Cluster.add_node`` arguments for host ``worker_id`` of the slice."""
        resources = {"TPU": self.tpu.host_chips, self.name: 1, f"accelerator_type:{self.tpu.ray_accelerator_type}": 1}
        if worker_id == 0:
            resources[self.tpu.head_resource] = 1
        return {
            "num_cpus": 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "resources": resources,
            "labels": {
                "ray.io/tpu-slice-name": self.name,
                "ray.io/tpu-worker-id": str(worker_id),
                "ray.io/tpu-topology": self.tpu.topology,
                "ray.io/tpu-pod-type": self.tpu.pod_type,
                "ray.io/accelerator-type": self.tpu.ray_accelerator_type,
            },
            "env_vars": {
                **self.env,
                "TPU_NAME": self.name,
                "TPU_WORKER_ID": str(worker_id),
                "TPU_ACCELERATOR_TYPE": self.tpu.pod_type,
                "TPU_TOPOLOGY": self.tpu.topology,
                "JAX_PLATFORMS": "cpu",
            },
        }

    def start(self) -> None:
        """Start the head and every host; Ray's files go to a private temp dir, not /tmp/ray."""
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="rtpu-", dir="/tmp")
        # RAY_TMPDIR keeps this cluster's address file out of /tmp/ray, so no other
        # process's ray.init() can stumble onto it (nor this one onto theirs).
        for key, value in {"RAY_TMPDIR": self.temp_dir, **self.env}.items():
            self._saved_environ.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False},
        )
        for worker_id in range(self.tpu.hosts_per_slice):
            self.add_host(worker_id)

    def add_host(self, worker_id: int) -> Any:
        """Start (or replace) host ``worker_id`` with the slice's labels, as KubeRay recreates a pod."""
        node = self.cluster.add_node(**self.host_args(worker_id))
        self.hosts[worker_id] = node
        return node

    def kill_host(self, worker_id: int) -> None:
        """Kill host ``worker_id``'s raylet and its workers at once (no graceful drain), like a lost VM."""
        node = self.hosts.pop(worker_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def ensure_hosts(self) -> None:
        """Re-add any host that is gone, so the next test gets a whole slice."""
        for worker_id in range(self.tpu.hosts_per_slice):
            if worker_id not in self.hosts:
                self.add_host(worker_id)

    def shutdown(self) -> None:
        """Stop every node, restore the environment and remove the temp dir."""
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        for key, value in self._saved_environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def worker_environment(fake_gcs: GcsStorage) -> dict[str, str]:
    """Environment for Ray nodes and driver subprocesses: the emulator, the repo on the path, quick health checks."""
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **fake_gcs.env,
        "PYTHONPATH": python_path,
        # Ray Train notices a dead worker within half a second and registers the last report.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "JAX_PLATFORMS": "cpu",
        # No usage reporting, and no Ray Data poller querying a Prometheus that is not there.
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DATA_USAGE_DISABLED": "1",
    }


def driver_env(ray_slice: EmulatedSlice) -> dict[str, str]:
    """Environment for a job driver subprocess: connect to the slice's cluster explicitly."""
    return {**os.environ, **ray_slice.env, "RAY_ADDRESS": ray_slice.address}
