"""RayClusters on this machine: the same RayCluster manifest KubeRay gets, with emulated TPU slices.

Each cluster is a Ray head plus one raylet per TPU host, every host carrying the TPU
resources, node labels and ``TPU_*`` environment a GKE TPU host gets, with JAX on the
CPU. Ray's own slice reservation (``ray.util.tpu.slice_placement_group``) and JaxTrainer
then run for real on the emulated slice.

A small supervisor process per cluster
(:mod:`airflow_provider_raytpu.backends.local_supervisor`) owns the Ray processes, so a
cluster outlives the task that made it, and recreates a whole slice when one of its hosts
dies, as KubeRay does. Clusters are recorded under
``<home>/clusters/<namespace>/<name>/`` where home is the connection's ``local_home``,
else ``$RAYTPU_HOME``, else ``~/.raytpu``. Status is synthesised as a RayCluster status
plus pod-like objects and read by :func:`airflow_provider_raytpu.status.read_ray_cluster`,
so READY / PROVISIONING / FAILED / GONE mean the same here as on Kubernetes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.base import Applied, ApplyResult, ClusterBackend, conflict_error, same_spec
from airflow_provider_raytpu.backends.local_supervisor import (
    CLUSTER_MARKER_ENV,
    LOGS_DIR,
    MANIFEST_FILE,
    POLL_SECONDS,
    STATE_FILE,
    SUPERVISOR_FILE,
    SUPERVISOR_LOG,
    TEMP_DIR_PREFIX,
    create_time_of,
    free_port,
    initial_state,
    cluster_processes,
    kill_processes,
    plan_cluster,
    process_alive,
    read_json,
    short_temp_root,
    tail,
    utc_now,
    write_json_atomic,
)
from airflow_provider_raytpu.backends.local_serve import LocalServeMixin
from airflow_provider_raytpu.backends.settings import ConnectionSettings
from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.status import (
    NODE_TYPE_LABEL,
    REPLICA_INDEX_LABEL,
    ClusterStatus,
    desired_hosts,
    diagnose_pods,
    pod_is_ready,
    read_ray_cluster,
)

DEFAULT_HOME = "~/.raytpu"
HOME_ENV = "RAYTPU_HOME"
SUPERVISOR_MODULE = "airflow_provider_raytpu.backends.local_supervisor"
STOP_TIMEOUT_SECONDS = 45.0
CLUSTER_LABEL = "ray.io/cluster"
GROUP_LABEL = "ray.io/group"
REPLICA_NAME_LABEL = "ray.io/worker-group-replica-name"
HOST_INDEX_LABEL = "ray.io/replica-host-index"
LOG_TAIL_LINES = 15
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_WAITING_REASONS = {
    "waiting": "WaitingForHead",
    "starting": "Starting",
    "restarting": "SliceRestarting",
    "failed": "SliceFailed",
}


def local_home(settings: ConnectionSettings) -> Path:
    """Where local clusters are recorded: ``local_home``, else ``$RAYTPU_HOME``, else ``~/.raytpu``."""
    text = settings.local_home or os.environ.get(HOME_ENV) or DEFAULT_HOME
    return Path(os.path.abspath(os.path.expanduser(text)))


def _check_name(value: str, field: str) -> str:
    if not isinstance(value, str) or not _DNS_LABEL.match(value):
        raise InvalidInputError(
            field, value, "is not a Kubernetes name", "Use lower-case letters, digits and '-' (at most 63)"
        )
    return value


# -- status synthesis: the local state as KubeRay would report it ----------------------------


@dataclass(frozen=True)
class StoredCluster:
    """A cluster's files as read at one moment.

    :param path: the state directory.
    :param manifest: the stored RayCluster (no status).
    :param state: the supervisor's ``state.json`` (``None`` while being created).
    :param supervisor: the backend's ``supervisor.json`` (pid, create time, incarnation).
    """

    path: Path
    manifest: dict[str, Any]
    state: dict[str, Any] | None
    supervisor: dict[str, Any] | None

    @property
    def supervisor_alive(self) -> bool:
        sup = self.supervisor or {}
        return process_alive(sup.get("pid"), sup.get("create_time"))

    @property
    def deleting(self) -> bool:
        return bool(self.manifest.get("metadata", {}).get("deletionTimestamp"))


def _condition(kind: str, true: bool, reason: str = "", message: str = "") -> dict[str, str]:
    condition = {"type": kind, "status": "True" if true else "False"}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    return condition


def _pod(name: str, namespace: str, labels: dict[str, str], host: Mapping[str, Any], alive: bool,
         waiting_reason: str, container: str) -> dict[str, Any]:
    ready = alive and bool(host.get("ready"))
    running = alive and bool(host.get("running"))
    status: dict[str, Any] = {
        "phase": "Running" if running else "Pending",
        "conditions": [_condition("Ready", ready)],
    }
    if not ready:
        status["containerStatuses"] = [
            {"name": container, "ready": False,
             "state": {"waiting": {"reason": waiting_reason, "message": host.get("message") or ""}}}
        ]
    annotations = {k: str(host[k]) for k in ("pid", "node_id", "log") if host.get(k) is not None}
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "annotations": {f"raytpu.dev/{k}": v for k, v in annotations.items()}},
        "status": status,
    }


def synthesise_status(stored: StoredCluster) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The RayCluster with a KubeRay-like ``status``, and pod-like objects for its hosts.

    ``status`` has ``HeadPodReady``, ``RayClusterProvisioned`` and (when something failed,
    or the supervisor is not running) ``ReplicaFailure`` conditions, ``desiredWorkerReplicas``
    and ``readyWorkerReplicas``; each host is a pod with the replica-index labels of KubeRay's
    multi-host indexing and a Ready condition that is true only once its raylet is ALIVE in the GCS.
    """
    cluster = copy.deepcopy(stored.manifest)
    metadata = cluster.setdefault("metadata", {})
    name, namespace = metadata.get("name", ""), metadata.get("namespace", "")
    state = stored.state or {}
    sup = stored.supervisor
    alive = stored.supervisor_alive
    starting = sup is None  # the backend is still starting the supervisor
    head = state.get("head") or {}
    slices = state.get("slices") or []
    head_ready = alive and bool(head.get("ready"))
    ready_hosts = sum(1 for s in slices for h in s.get("hosts", []) if h.get("ready")) if alive else 0
    want = desired_hosts(cluster)
    conditions = [
        _condition("HeadPodReady", head_ready, "HeadPodRunningAndReady" if head_ready else "HeadPodNotReady"),
        _condition("RayClusterProvisioned", head_ready and ready_hosts >= want,
                   "AllPodRunningAndReadyFirstTime" if head_ready and ready_hosts >= want else "RayClusterPodsProvisioning"),
    ]
    failure = state.get("failure")
    if failure:
        conditions.append(_condition("ReplicaFailure", True, failure.get("reason", "Failed"), failure.get("message", "")))
    elif not alive and not starting and not stored.deleting:
        log_path = stored.path / SUPERVISOR_LOG
        conditions.append(_condition(
            "ReplicaFailure", True, "SupervisorNotRunning",
            f"the local supervisor (pid {sup.get('pid') if sup else None}) of RayCluster {name!r} is not running, "
            f"so none of its Ray processes are; see {log_path}. Apply the cluster again to restart it, or delete it",
        ))
    status: dict[str, Any] = {
        "desiredWorkerReplicas": want,
        "readyWorkerReplicas": ready_hosts,
        "availableWorkerReplicas": ready_hosts,
        "conditions": conditions,
        "observedGeneration": metadata.get("generation", 1),
    }
    if state.get("suspended"):
        status["state"] = "suspended"
    elif head_ready and ready_hosts >= want:
        status["state"] = "ready"
    if state.get("dashboard_url"):
        status["endpoints"] = {"dashboard": state["dashboard_url"].rsplit(":", 1)[1],
                               "gcs-server": state.get("gcs_address", ":").rsplit(":", 1)[1]}
    cluster["status"] = status

    def not_alive_reason(default: str) -> str:
        return default if alive or starting else "SupervisorNotRunning"

    base_labels = {CLUSTER_LABEL: name}
    pods = []
    if state:
        pods.append(_pod(
            f"{name}-head", namespace, {**base_labels, NODE_TYPE_LABEL: "head", GROUP_LABEL: "headgroup"}, head,
            alive, not_alive_reason("Starting"), "ray-head",
        ))
    group = ((cluster.get("spec") or {}).get("workerGroupSpecs") or [{}])[0].get("groupName", "workers")
    for slice_ in slices:
        reason = not_alive_reason(_WAITING_REASONS.get(slice_.get("status", ""), "Starting"))
        for host in slice_.get("hosts", []):
            labels = {
                **base_labels,
                NODE_TYPE_LABEL: "worker",
                GROUP_LABEL: group,
                REPLICA_INDEX_LABEL: str(slice_["index"]),
                REPLICA_NAME_LABEL: slice_.get("name", ""),
                HOST_INDEX_LABEL: str(host.get("worker_id")),
            }
            message_host = dict(host)
            if not host.get("ready") and slice_.get("message") and slice_.get("status") != "ready":
                message_host["message"] = f"{host.get('message') or ''} ({slice_['message']})".strip()
            pods.append(_pod(
                f"{name}-{group}-s{slice_['index']}-h{host.get('worker_id')}", namespace, labels, message_host,
                alive, reason, "ray-worker",
            ))
    return cluster, pods


# -- label selectors (the subset Kubernetes offers for equality and sets) --------------------

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def selector_matches(labels: Mapping[str, str], selector: str) -> bool:
    """Whether labels match a Kubernetes label selector (``a=b``, ``a!=b``, ``a``, ``!a``, ``a in (b,c)``)."""
    for term in _split_selector(selector or ""):
        if match := _SET_TERM.match(term):
            key, op, values = match.group(1), match.group(2), {v.strip() for v in match.group(3).split(",")}
            if (labels.get(key) in values) != (op == "in") or (op == "in" and key not in labels):
                return False
        elif "!=" in term:
            key, value = (p.strip() for p in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (p.strip() for p in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def stored_cluster_form(manifest: dict[str, Any], existing: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest as stored: server-like metadata added (merged over an existing one on update)."""
    stored = copy.deepcopy({k: v for k, v in manifest.items() if k != "status"})
    metadata = stored.setdefault("metadata", {})
    if existing is None:
        metadata.update({"uid": str(uuid.uuid4()), "creationTimestamp": utc_now(), "generation": 1})
    else:
        old = existing.get("metadata", {})
        metadata.update({
            "uid": old.get("uid", str(uuid.uuid4())),
            "creationTimestamp": old.get("creationTimestamp", utc_now()),
            "generation": int(old.get("generation", 1)) + 1,
            "labels": {**(old.get("labels") or {}), **(metadata.get("labels") or {})},
            "annotations": {**(old.get("annotations") or {}), **(metadata.get("annotations") or {})},
        })
    return stored


# -- the backend -----------------------------------------------------------------------------


class LocalBackend(LocalServeMixin, ClusterBackend):
    """RayClusters as local Ray processes with emulated TPU slices.

    :param settings: the parsed ``raytpu`` connection (backend ``local``); ``local_home``
        and ``local_max_hosts`` apply.
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        super().__init__(settings)
        self.home = local_home(settings)

    # -- files --------------------------------------------------------------------------------

    @property
    def clusters_root(self) -> Path:
        return self.home / "clusters"

    def cluster_dir(self, name: str, namespace: str) -> Path:
        """The cluster's state directory (whether or not it exists)."""
        return self.clusters_root / _check_name(namespace, "namespace") / _check_name(name, "cluster_name")

    @contextlib.contextmanager
    def _lock(self, name: str, namespace: str) -> Iterator[None]:
        """Serialise apply/delete of one cluster across processes (``fcntl.flock``)."""
        parent = self.cluster_dir(name, namespace).parent
        parent.mkdir(parents=True, exist_ok=True)
        with open(parent / f".{name}.lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _read(self, name: str, namespace: str) -> StoredCluster | None:
        path = self.cluster_dir(name, namespace)
        manifest = read_json(path / MANIFEST_FILE)
        if manifest is None:
            return None
        return StoredCluster(path, manifest, read_json(path / STATE_FILE), read_json(path / SUPERVISOR_FILE))

    def state(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The supervisor's ``state.json`` (pids, ports, per-slice hosts), or ``None``."""
        stored = self._read(name, namespace)
        return stored.state if stored else None

    def supervisor(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The supervisor's pid, create time and incarnation, or ``None``."""
        stored = self._read(name, namespace)
        return stored.supervisor if stored else None

    def _require(self, name: str, namespace: str) -> StoredCluster:
        stored = self._read(name, namespace)
        if stored is None or stored.state is None:
            raise FatalError(
                f"RayCluster {name!r} does not exist in namespace {namespace!r} on the local backend "
                f"(looked in {self.cluster_dir(name, namespace)}); create it first"
            )
        return stored

    def gcs_address(self, name: str, namespace: str) -> str:
        """The cluster's GCS address (``127.0.0.1:<port>``), for ``ray.init(address=...)``."""
        return self._require(name, namespace).state["gcs_address"]  # type: ignore[index]

    def cluster_processes(self, name: str, namespace: str) -> list[int]:
        """Pids of every process of the cluster: its supervisor, Ray daemons, workers and job drivers."""
        stored = self._read(name, namespace)
        if stored is None or not stored.supervisor:
            return []
        processes, _ = self._processes(stored, stored.supervisor_alive)
        return sorted(p.pid for p in processes)

    @staticmethod
    def _processes(stored: StoredCluster, session_is_ours: bool) -> tuple[list[Any], bool]:
        sup = stored.supervisor or {}
        found: dict[int, Any] = {}
        verified = session_is_ours
        for incarnation in {i for i in (sup.get("incarnation"), (stored.state or {}).get("incarnation")) if i}:
            mine = sup.get("incarnation") == incarnation
            processes, ours = cluster_processes(incarnation, sup.get("pgid", sup.get("pid")) if mine else None,
                                                verified if mine else False)
            verified = verified or (ours and mine)
            found.update({p.pid: p for p in processes})
        return list(found.values()), verified

    # -- lifecycle ----------------------------------------------------------------------------

    def check(self) -> str:
        try:
            version = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is None or importlib.util.find_spec("ray.scripts.scripts") is None:
            raise FatalError(
                "The local backend runs Ray on this machine, but Ray is not installed in "
                f"{sys.executable}: pip install 'airflow-provider-raytpu[local]'"
            )
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
        plan = plan_cluster(manifest, self.settings.local_max_hosts)
        name, namespace = plan.name, plan.namespace
        self.cluster_dir(name, namespace)  # validates both names before anything is written
        with self._lock(name, namespace):
            stored = self._read(name, namespace)
            if stored is not None and stored.deleting:
                # A delete that did not finish: finish it, then create afresh.
                self._stop(stored)
                self._remove(stored)
                stored = None
            if stored is None:
                self._start(stored_cluster_form(manifest, None), fresh=True)
                return ApplyResult(Applied.CREATED, self._cluster(name, namespace))
            if same_spec(stored.manifest, manifest):
                if not stored.supervisor_alive:
                    self._stop(stored)  # leftovers of the dead incarnation, if any
                    self._start(stored.manifest, fresh=False, previous=stored.state)
                return ApplyResult(Applied.ADOPTED, self._cluster(name, namespace))
            if not update_if_exists:
                raise conflict_error(stored.manifest, manifest)
            self._stop(stored)
            self._start(stored_cluster_form(manifest, stored.manifest), fresh=False, previous=stored.state)
            return ApplyResult(Applied.UPDATED, self._cluster(name, namespace))

    def _start(self, manifest: dict[str, Any], *, fresh: bool, previous: dict[str, Any] | None = None) -> None:
        """Write the manifest and a fresh state, then start a supervisor (called under the lock)."""
        plan = plan_cluster(manifest)
        path = self.cluster_dir(plan.name, plan.namespace)
        if fresh and path.exists():
            shutil.rmtree(path)
        (path / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        incarnation = uuid.uuid4().hex[:12]
        gcs_port, dashboard_port = free_port(), free_port()
        if previous:  # keep the old addresses when they are free, so references stay valid
            gcs_port = _port_if_free(previous.get("gcs_address"), gcs_port)
            dashboard_port = _port_if_free(previous.get("dashboard_url"), dashboard_port)
        temp_dir = short_temp_root() / f"{TEMP_DIR_PREFIX}{incarnation}"
        state = initial_state(plan, incarnation=incarnation, gcs_port=gcs_port, dashboard_port=dashboard_port,
                              temp_dir=str(temp_dir), state_dir=path)
        with contextlib.suppress(FileNotFoundError):
            (path / SUPERVISOR_FILE).unlink()
        write_json_atomic(path / STATE_FILE, state)
        write_json_atomic(path / MANIFEST_FILE, manifest)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env[CLUSTER_MARKER_ENV] = incarnation
        with open(path / SUPERVISOR_LOG, "ab") as out:
            out.write(f"\n=== {utc_now()} supervisor for incarnation {incarnation}\n".encode())
            out.flush()
            process = subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(path)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=path, env=env,
                start_new_session=True,
            )
        write_json_atomic(path / SUPERVISOR_FILE, {
            "pid": process.pid,
            "pgid": process.pid,
            "create_time": create_time_of(process.pid),
            "incarnation": incarnation,
            "started_at": utc_now(),
            "log": str(path / SUPERVISOR_LOG),
        })

    def _stop(self, stored: StoredCluster) -> None:
        """Stop exactly this cluster's processes: its supervisor (which stops its Ray nodes), then any rest.

        Never ``ray stop``: other Ray clusters on the machine are left alone. The rest is
        found by :func:`~airflow_provider_raytpu.backends.local_supervisor.cluster_processes`
        (the incarnation's environment marker and the supervisor's session).
        """
        import psutil

        sup = stored.supervisor or {}
        alive = stored.supervisor_alive
        snapshot, verified = self._processes(stored, alive)  # before the supervisor is gone
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(sup["pid"], signal.SIGTERM)
            try:
                psutil.Process(sup["pid"]).wait(timeout=STOP_TIMEOUT_SECONDS)
            except psutil.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sup["pid"], signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        # A dying Ray node can still spawn a process (an agent): look again until nothing is left.
        for _ in range(5):
            found, verified = self._processes(stored, verified)
            remaining = [p for p in {**{p.pid: p for p in snapshot}, **{p.pid: p for p in found}}.values()
                         if _running(p)]
            snapshot = []
            if not remaining:
                return
            kill_processes(remaining, 3.0)

    def _remove(self, stored: StoredCluster) -> None:
        temp_dir = (stored.state or {}).get("temp_dir")
        if temp_dir and Path(temp_dir).name.startswith(TEMP_DIR_PREFIX):
            shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(stored.path, ignore_errors=True)

    def delete_cluster(self, name: str, namespace: str) -> bool:
        with self._lock(name, namespace):
            stored = self._read(name, namespace)
            if stored is None:
                path = self.cluster_dir(name, namespace)
                if path.exists():  # a create that never wrote its manifest
                    shutil.rmtree(path, ignore_errors=True)
                return False
            marked = copy.deepcopy(stored.manifest)
            marked.setdefault("metadata", {}).setdefault("deletionTimestamp", utc_now())
            write_json_atomic(stored.path / MANIFEST_FILE, marked)
            self._stop(stored)
            self._remove(stored)
            return True

    # -- reading ------------------------------------------------------------------------------

    def _cluster(self, name: str, namespace: str) -> dict[str, Any]:
        cluster = self.get_cluster(name, namespace)
        if cluster is None:
            raise FatalError(f"RayCluster {name!r} in {namespace!r} vanished while it was being applied")
        return cluster

    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        stored = self._read(name, namespace)
        return synthesise_status(stored)[0] if stored else None

    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        if namespace is None:
            roots = sorted(p for p in self.clusters_root.glob("*") if p.is_dir()) if self.clusters_root.is_dir() else []
        else:
            roots = [self.clusters_root / _check_name(namespace, "namespace")]
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

    def cluster_status(self, name: str, namespace: str) -> ClusterStatus:
        stored = self._read(name, namespace)
        if stored is None:
            return read_ray_cluster(None)
        return read_ray_cluster(*synthesise_status(stored))

    def diagnose(self, name: str, namespace: str) -> str:
        stored = self._read(name, namespace)
        if stored is None:
            return read_ray_cluster(None).message
        cluster, pods = synthesise_status(stored)
        lines = [diagnose_pods(read_ray_cluster(cluster, pods), pods)]
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

    def dashboard_url(self, name: str, namespace: str) -> str:
        return self._require(name, namespace).state["dashboard_url"]  # type: ignore[index]

    # -- async --------------------------------------------------------------------------------

    def _signature(self, name: str, namespace: str) -> tuple[Any, ...]:
        path = self.cluster_dir(name, namespace)
        stamps = []
        for file in (MANIFEST_FILE, STATE_FILE, SUPERVISOR_FILE):
            try:
                stamps.append(os.stat(path / file).st_mtime_ns)
            except FileNotFoundError:
                stamps.append(None)
        sup = read_json(path / SUPERVISOR_FILE) if stamps[2] else None
        alive = process_alive(sup.get("pid"), sup.get("create_time")) if sup else None
        return (*stamps, alive)

    async def watch_cluster(
        self, name: str, namespace: str, poll_interval: float = POLL_SECONDS
    ) -> AsyncIterator[ClusterStatus]:
        """Yield the status now and whenever it changes.

        There is no watch API locally: the state files are polled every
        ``min(poll_interval, 0.5)`` seconds (a few ``stat`` calls and one pid check), and
        the status is recomputed only when one of them changed.

        :param poll_interval: the longest time between two polls.
        """
        interval = min(poll_interval, POLL_SECONDS)
        last_signature: tuple[Any, ...] | None = None
        last: ClusterStatus | None = None
        while True:
            signature = self._signature(name, namespace)
            if signature != last_signature:
                last_signature = signature
                status = await asyncio.to_thread(self.cluster_status, name, namespace)
                if status != last:
                    last = status
                    yield status
            await asyncio.sleep(interval)

    async def adiagnose(self, name: str, namespace: str) -> str:
        return await asyncio.to_thread(self.diagnose, name, namespace)


def _running(process: Any) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _port_if_free(address: str | None, fallback: int) -> int:
    """The port of ``address`` if it can be bound on 127.0.0.1 now, else ``fallback``."""
    if not address:
        return fallback
    try:
        port = int(str(address).rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
        return port
    except (ValueError, IndexError, OSError):
        return fallback
