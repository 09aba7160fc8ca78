"""RayClusters on this machine: the same RayCluster manifest KubeRay gets, with emulated TPU slices.

Each cluster is a Ray head plus one raylet per TPU host, every host carrying the TPU
resources, node labels and ``TPU_*`` environment a GKE TPU host gets, with JAX on the
CPU (:mod:`~airflow_provider_raytpu.backends.local.plan`). Ray's own slice reservation
(``ray.util.tpu.slice_placement_group``) and JaxTrainer then run for real on the emulated
slice.

A small supervisor process per cluster
(:mod:`airflow_provider_raytpu.backends.local.supervisor`) owns the Ray processes, so a
cluster outlives the task that made it, and recreates a whole slice when one of its hosts
dies, as KubeRay does. Clusters are recorded under the connection's home
(:mod:`~airflow_provider_raytpu.backends.local.state`). Status is synthesised as a
RayCluster status plus pod-like objects (:mod:`~airflow_provider_raytpu.backends.local.status`)
and read by :func:`airflow_provider_raytpu.status.read_ray_cluster`, so READY /
PROVISIONING / FAILED / GONE mean the same here as on Kubernetes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.apply import CLUSTER_OWNER, ObjectStore, OnChange, apply_object, same_spec
from airflow_provider_raytpu.backends.base import (
    Applied,
    ApplyResult,
    ChangedSinceChecked,
    ClusterBackend,
    Precondition,
)
from airflow_provider_raytpu.backends.local.lifecycle import processes_of, remove_cluster, start_cluster, stop_cluster
from airflow_provider_raytpu.backends.local.plan import plan_cluster
from airflow_provider_raytpu.backends.local.process import (
    file_lock,
    process_alive,
    read_json,
    tail,
    utc_now,
    write_json_atomic,
)
from airflow_provider_raytpu.backends.local.selectors import selector_matches
from airflow_provider_raytpu.backends.local.serve import LocalServices
from airflow_provider_raytpu.backends.local.state import (
    CLUSTERS_DIR,
    MANIFEST_FILE,
    POLL_SECONDS,
    STATE_FILE,
    SUPERVISOR_FILE,
    SUPERVISOR_LOG,
    StoredCluster,
    check_name,
    cluster_dir,
    local_home,
    next_version,
    stored_form,
)
from airflow_provider_raytpu.backends.local.status import synthesise_status
from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.dashboard.nodes import confirm
from airflow_provider_raytpu.dashboard.transport import DirectTransport, HttpTransport
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.status import (
    RAY_UNCONFIRMED,
    ClusterStatus,
    diagnose_pods,
    pod_is_ready,
    read_ray_cluster,
)
from airflow_provider_raytpu.status.kueue import queue_of

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 15


def _applied(backend: LocalBackend, name: str, namespace: str) -> dict[str, Any]:
    cluster = backend.get_cluster(name, namespace)
    if cluster is None:
        raise FatalError(f"RayCluster {name!r} in {namespace!r} vanished while it was being applied")
    return cluster


class _ClusterFiles(ObjectStore):
    """A local cluster's files as the :class:`~airflow_provider_raytpu.backends.apply.ObjectStore` of
    :func:`~airflow_provider_raytpu.backends.apply.apply_object`: creating one starts its supervisor,
    deleting one stops its processes and removes its files (a changed spec is recreated, as on
    KubeRay). Used under the cluster's lock, so create never raises ``AlreadyExists``.
    """

    def __init__(self, backend: LocalBackend, path: Path) -> None:
        self.backend, self.path = backend, path

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.backend.get_cluster(name, namespace)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        start_cluster(self.path, stored_form(manifest, None), fresh=True)
        return _applied(self.backend, manifest["metadata"]["name"], manifest["metadata"]["namespace"])

    def delete(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        return self.backend.remove_locked(name, namespace, precondition)


class LocalBackend(ClusterBackend):
    """RayClusters as local Ray processes with emulated TPU slices.

    Its RayServices (:attr:`services`) are :class:`~airflow_provider_raytpu.backends.local.serve.LocalServices`.

    :param settings: the parsed ``raytpu`` connection (backend ``local``); ``local_home``
        and ``local_max_hosts`` apply.
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        super().__init__(settings)
        self.home = local_home(settings)
        self.services = LocalServices(self, self.home)

    # -- files --------------------------------------------------------------------------------

    @property
    def clusters_root(self) -> Path:
        return self.home / CLUSTERS_DIR

    def cluster_dir(self, name: str, namespace: str) -> Path:
        """The cluster's state directory (whether or not it exists)."""
        return cluster_dir(self.home, name, namespace)

    @contextlib.contextmanager
    def _lock(self, name: str, namespace: str) -> Iterator[None]:
        """Serialise apply/delete of one cluster across processes."""
        with file_lock(self.cluster_dir(name, namespace).parent / f".{name}.lock"):
            yield

    def _read(self, name: str, namespace: str) -> StoredCluster | None:
        return StoredCluster.read(self.cluster_dir(name, namespace))

    def state(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The supervisor's ``state.json`` (pids, ports, per-slice hosts), or ``None``."""
        stored = self._read(name, namespace)
        return stored.state if stored else None

    def supervisor(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The supervisor's pid, create time and incarnation, or ``None``."""
        stored = self._read(name, namespace)
        return stored.supervisor if stored else None

    def _require_state(self, name: str, namespace: str) -> dict[str, Any]:
        stored = self._read(name, namespace)
        if stored is None or stored.state is None:
            raise FatalError(
                f"RayCluster {name!r} does not exist in namespace {namespace!r} on the local backend "
                f"(looked in {self.cluster_dir(name, namespace)}); create it first"
            )
        return stored.state

    def gcs_address(self, name: str, namespace: str) -> str:
        """The cluster's GCS address (``127.0.0.1:<port>``), for ``ray.init(address=...)``."""
        address: str = self._require_state(name, namespace)["gcs_address"]
        return address

    def cluster_processes(self, name: str, namespace: str) -> list[int]:
        """Pids of every process of the cluster: its supervisor, Ray daemons, workers and job drivers."""
        stored = self._read(name, namespace)
        if stored is None or not stored.supervisor:
            return []
        processes, _ = processes_of(stored, stored.supervisor_alive)
        return sorted(p.pid for p in processes)

    # -- lifecycle ----------------------------------------------------------------------------

    @staticmethod
    def ray_version() -> str:
        """The Ray this machine runs clusters with.

        :raises FatalError: Ray is not installed (the provider's ``local`` extra brings it).
        """
        try:
            version: str | None = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is None or importlib.util.find_spec("ray.scripts.scripts") is None:
            raise FatalError(
                "The local backend runs Ray on this machine, but Ray is not installed in "
                f"{sys.executable}: pip install 'airflow-provider-raytpu[local]'"
            )
        return version

    def check(self) -> str:
        version = self.ray_version()
        self.clusters_root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.clusters_root, os.W_OK):
            raise FatalError(f"The local backend cannot write its state directory {self.clusters_root}")
        clusters = self.list_clusters(None, "")
        running = sum(1 for c in clusters if any(
            cond["type"] == "HeadPodReady" and cond["status"] == "True" for cond in c["status"]["conditions"]
        ))
        return (
            f"Local backend: Ray {version} ({sys.executable}); state in {self.home} "
            f"({len(clusters)} RayCluster(s), {running} with a running head); "
            f"slices of up to {self.settings.local_max_hosts} hosts are emulated"
        )

    def apply_cluster(self, manifest: dict[str, Any], *, update_if_exists: bool = False) -> ApplyResult:
        self.ray_version()  # before anything is written: a cluster without Ray would only fail later
        plan = plan_cluster(manifest, self.settings.local_max_hosts)
        name, namespace = plan.name, plan.namespace
        if queue := queue_of(manifest):
            log.warning("RayCluster %s/%s is put in Kueue LocalQueue %s; the local backend has no Kueue: it starts "
                        "at once", namespace, name, queue)
        path = self.cluster_dir(name, namespace)  # validates both names before anything is written
        with self._lock(name, namespace):
            stored = self._read(name, namespace)
            if stored is not None and stored.deleting:
                # A delete that did not finish: finish it, then create afresh.
                stop_cluster(stored)
                remove_cluster(stored)
            result = apply_object(_ClusterFiles(self, path), manifest, same=same_spec, owner=CLUSTER_OWNER,
                                  on_change=OnChange.RECREATE if update_if_exists else OnChange.FAIL)
            stored = self._read(name, namespace)
            if result.action is Applied.ADOPTED and stored is not None and not stored.supervisor_alive:
                stop_cluster(stored)  # leftovers of the dead incarnation, if any
                start_cluster(path, stored.manifest, fresh=False, previous=stored.state)
                result = ApplyResult(Applied.ADOPTED, _applied(self, name, namespace))
            return result

    def delete_cluster(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        with self._lock(name, namespace):
            return self.remove_locked(name, namespace, precondition)

    def annotate_cluster(self, name: str, namespace: str, annotations: dict[str, str]) -> None:
        """Set annotations in the cluster's stored manifest (its supervisor reads a renewed expiry from it)."""
        with self._lock(name, namespace):
            stored = self._read(name, namespace)
            if stored is None:
                raise FatalError(f"RayCluster {namespace}/{name} does not exist")
            manifest = copy.deepcopy(stored.manifest)
            manifest.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
            write_json_atomic(stored.path / MANIFEST_FILE, next_version(manifest))

    def remove_locked(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        """Delete the cluster (its lock held): mark it deleted, stop its processes, remove its files.

        :raises ChangedSinceChecked: it is not the cluster ``precondition`` names; nothing is removed.
        """
        stored = self._read(name, namespace)
        if stored is None:
            path = self.cluster_dir(name, namespace)
            if path.exists():  # a create that never wrote its manifest
                shutil.rmtree(path, ignore_errors=True)
            return False
        if precondition is not None and (unmet := precondition.unmet(stored.manifest)):
            raise ChangedSinceChecked("RayCluster", name, namespace, unmet)
        marked = copy.deepcopy(stored.manifest)
        marked.setdefault("metadata", {}).setdefault("deletionTimestamp", utc_now())
        write_json_atomic(stored.path / MANIFEST_FILE, marked)
        stop_cluster(stored)
        remove_cluster(stored)
        return True

    # -- reading ------------------------------------------------------------------------------

    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        stored = self._read(name, namespace)
        return synthesise_status(stored)[0] if stored else None

    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        if namespace is None:
            roots = sorted(p for p in self.clusters_root.glob("*") if p.is_dir()) if self.clusters_root.is_dir() else []
        else:
            roots = [self.clusters_root / check_name(namespace, "namespace")]
        found = []
        for root in roots:
            if not root.is_dir():
                continue
            for path in sorted(p for p in root.iterdir() if p.is_dir()):
                stored = self._read(path.name, root.name)
                if stored is None:
                    continue
                labels = stored.manifest.get("metadata", {}).get("labels") or {}
                if selector_matches(labels, label_selector):
                    found.append(synthesise_status(stored)[0])
        return found

    def cluster_status(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> ClusterStatus:
        stored = self._read(name, namespace)
        if stored is None:
            return read_ray_cluster(None)
        cluster, pods = synthesise_status(stored)
        status = read_ray_cluster(cluster, pods)
        return confirm(status, pods, self.dashboard(name, namespace)) if confirm_with_ray else status

    def diagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        stored = self._read(name, namespace)
        if stored is None:
            return read_ray_cluster(None).message
        cluster, pods = synthesise_status(stored)
        status = read_ray_cluster(cluster, pods)
        if confirm_with_ray:
            status = confirm(status, pods, self.dashboard(name, namespace))
        lines = [diagnose_pods(status, pods)]
        if stored.supervisor and not stored.supervisor_alive:
            lines += [f"--- last lines of {stored.path / SUPERVISOR_LOG} (supervisor) ---",
                      tail(stored.path / SUPERVISOR_LOG, LOG_TAIL_LINES)]
        shown = 0
        for pod in pods:
            log_path = pod["metadata"]["annotations"].get("raytpu.dev/log")
            if pod_is_ready(pod) or not log_path or shown >= 4:
                continue
            text = tail(log_path, LOG_TAIL_LINES)
            if text:
                lines += [f"--- last lines of {log_path} ({pod['metadata']['name']}) ---", text]
                shown += 1
        return "\n".join(lines)

    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The head's dashboard, ``http://127.0.0.1:<port>``."""
        return DirectTransport(self._require_state(name, namespace)["dashboard_url"])

    # -- async --------------------------------------------------------------------------------

    def _signature(self, name: str, namespace: str) -> tuple[Any, ...]:
        path = self.cluster_dir(name, namespace)
        stamps: list[int | None] = []
        for file in (MANIFEST_FILE, STATE_FILE, SUPERVISOR_FILE):
            try:
                stamps.append(os.stat(path / file).st_mtime_ns)
            except FileNotFoundError:
                stamps.append(None)
        sup = read_json(path / SUPERVISOR_FILE) if stamps[2] else None
        alive = process_alive(sup.get("pid"), sup.get("create_time")) if sup else None
        return (*stamps, alive)

    async def watch_cluster(
        self, name: str, namespace: str, poll_interval: float = POLL_SECONDS, *, confirm_with_ray: bool = False
    ) -> AsyncGenerator[ClusterStatus, None]:
        """Yield the status now and whenever it changes.

        There is no watch API locally: the state files are polled every
        ``min(poll_interval, 0.5)`` seconds (a few ``stat`` calls and one pid check), and
        the status is recomputed only when one of them changed, or ``poll_interval`` seconds
        after Ray did not yet confirm a READY.

        :param poll_interval: the longest time between two polls.
        :param confirm_with_ray: as in :meth:`cluster_status`.
        """
        interval = min(poll_interval, POLL_SECONDS)
        read = functools.partial(self.cluster_status, confirm_with_ray=confirm_with_ray)
        last_signature: tuple[Any, ...] | None = None
        last: ClusterStatus | None = None
        ask_ray_again: float | None = None
        while True:
            signature = self._signature(name, namespace)
            if signature != last_signature or (ask_ray_again is not None and time.monotonic() >= ask_ray_again):
                last_signature = signature
                status = await asyncio.to_thread(read, name, namespace)
                ask_ray_again = time.monotonic() + poll_interval if status.reason == RAY_UNCONFIRMED else None
                if status != last:
                    last = status
                    yield status
            await asyncio.sleep(interval)

    async def adiagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        return await asyncio.to_thread(functools.partial(self.diagnose_cluster, confirm_with_ray=confirm_with_ray),
                                       name, namespace)
