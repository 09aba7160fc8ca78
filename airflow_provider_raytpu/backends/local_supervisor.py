"""The per-cluster supervisor of the ``local`` backend: a Ray head plus one raylet per TPU host.

Run as ``python -m airflow_provider_raytpu.backends.local_supervisor <state-dir>``; the
backend (:mod:`airflow_provider_raytpu.backends.local`) starts it detached, so a cluster
outlives the Airflow task that made it. The supervisor

- reads ``manifest.json`` (the RayCluster as KubeRay would get it) and the initial
  ``state.json`` (ports, temp dir, incarnation) from its state directory;
- starts ``ray start --head --block`` and, once the head is registered in the GCS and
  its dashboard answers, one ``ray start --address=... --block`` per TPU host, the hosts
  of a slice in parallel, each with the TPU resources, node labels and environment a GKE
  TPU host gets (so Ray's own TPU placement works on the emulated slice);
- like KubeRay with multi-host indexing, recreates a WHOLE slice when one of its hosts
  dies (stops the survivors, starts every host again); a dead head recreates everything;
- publishes what it sees to ``state.json`` (atomically, only when it changes); a host is
  ready only once its raylet is registered ALIVE in the GCS (one cheap ``GcsClient`` call);
- on SIGTERM stops exactly its own processes and exits. It is a session leader and every
  process it starts inherits the environment variable :data:`CLUSTER_MARKER_ENV` = the
  cluster's incarnation; together (Ray daemons overwrite their environment when they
  rename themselves, Ray job drivers leave the session) they let the backend find all of
  its processes and nothing else (:func:`cluster_processes`). Its ``ray start`` children
  get SIGTERM if the supervisor itself dies.

Of the manifest's ``rayStartParams`` only ``num-cpus`` (capped at 1, to keep the machine
usable) and ``resources`` are honoured; the head always binds 127.0.0.1. Two knobs, read
from the environment of the process that applies the cluster (the supervisor inherits it):
``RAYTPU_LOCAL_START_TIMEOUT`` (seconds a node may take to register, default 180) and
``RAYTPU_LOCAL_MAX_FAILED_STARTS`` (failed starts in a row before the head or a slice is
FAILED, default 3).

``state.json`` (the contract with the backend; version 1)::

    {"version": 1, "name", "namespace", "incarnation", "phase": starting|running|stopping|stopped,
     "supervisor_pid", "gcs_address", "dashboard_url", "temp_dir", "suspended",
     "head": HOST, "slices": [{"index", "name", "status": waiting|starting|ready|restarting|failed,
                               "message", "restarts", "failed_starts", "hosts": [HOST, ...]}],
     "failure": null | {"reason", "message"}, "updated_at"}
    HOST = {"key", "worker_id", "pid", "create_time", "running", "ready", "node_id",
            "node_manager_port", "exit_code", "message", "log", "started_at"}

The module imports Ray only inside the running supervisor (for ``GcsClient``); the plan
(:func:`plan_cluster`) and the state helpers are pure and used by the backend too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import tpu_slice_of
from airflow_provider_raytpu.tpu import TPU_RESOURCE, TpuSlice

log = logging.getLogger("airflow_provider_raytpu.local_supervisor")

STATE_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
SUPERVISOR_FILE = "supervisor.json"
SUPERVISOR_LOG = "supervisor.log"
LOGS_DIR = "logs"
CLUSTER_MARKER_ENV = "RAYTPU_LOCAL_CLUSTER"
TEMP_DIR_PREFIX = "raytpu-"

OBJECT_STORE_BYTES = 150 * 1024 * 1024
HEAD_MAX_CPUS = 1
HOST_MAX_CPUS = 1
POLL_SECONDS = 0.5
READY_CHECK_SECONDS = 2.0
START_TIMEOUT_SECONDS = float(os.environ.get("RAYTPU_LOCAL_START_TIMEOUT", "180"))
STOP_GRACE_SECONDS = 10.0
MAX_FAILED_STARTS = int(os.environ.get("RAYTPU_LOCAL_MAX_FAILED_STARTS", "3"))
MAX_BACKOFF_SECONDS = 30.0
UNIX_SOCKET_LIMIT = 108
# "/raytpu-<12 hex>" + "/s99h99" + "/session_2026-12-02_16-24-34_486778_4194304" + "/sockets/plasma_store"
_SOCKET_PATH_BUDGET = 20 + 7 + 44 + 21

# Environment a node must not inherit from whoever started the supervisor.
_SCRUBBED_ENV = ("RAY_ADDRESS", "TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
                 "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS")

LABEL_SLICE_NAME = "ray.io/tpu-slice-name"
LABEL_WORKER_ID = "ray.io/tpu-worker-id"
LABEL_TOPOLOGY = "ray.io/tpu-topology"
LABEL_POD_TYPE = "ray.io/tpu-pod-type"
LABEL_ACCELERATOR_TYPE = "ray.io/accelerator-type"


# -- the plan: what the manifest asks for, as local Ray nodes -------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """One local Ray node: the head or one TPU host.

    :param key: ``head`` or ``s<slice>h<host>``; names its log and temp dir.
    :param num_cpus: ``--num-cpus``.
    :param resources: custom resources (``--resources``).
    :param labels: node labels (``--labels``).
    :param env: environment added to the node's processes.
    :param slice_index: the slice (replica index) of a TPU host.
    :param worker_id: the host's index within its slice (``TPU_WORKER_ID``).
    """

    key: str
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    slice_index: int | None = None
    worker_id: int | None = None


@dataclass(frozen=True)
class LocalPlan:
    """A RayCluster manifest interpreted for this machine.

    :param name: the cluster name.
    :param namespace: its namespace.
    :param tpu: the slice shape from the manifest's annotation.
    :param group_name: the TPU worker group's name.
    :param head: the head node.
    :param slices: per slice, its hosts in worker-id order.
    :param slice_names: the slice names (``TPU_NAME``), ``<cluster>-slice-<i>``.
    :param suspended: ``spec.suspend``; nothing is started.
    """

    name: str
    namespace: str
    tpu: TpuSlice
    group_name: str
    head: NodeSpec
    slices: tuple[tuple[NodeSpec, ...], ...]
    slice_names: tuple[str, ...]
    suspended: bool = False

    @property
    def total_hosts(self) -> int:
        return sum(len(hosts) for hosts in self.slices)


def slice_name(cluster_name: str, index: int) -> str:
    """The name of slice ``index`` of a cluster (its ``TPU_NAME`` and Ray resource)."""
    return f"{cluster_name}-slice-{index}"


def parse_cpu(value: Any) -> float:
    """A Kubernetes CPU quantity (``2``, ``"500m"``, ``"1.5"``) in cores."""
    text = str(value).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise InvalidInputError("cpu", value, "is not a Kubernetes CPU quantity", "Write e.g. '2' or '500m'") from None


def _ray_param_resources(params: Mapping[str, Any], where: str) -> dict[str, float]:
    text = str(params.get("resources") or "").strip()
    if not text:
        return {}
    while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    try:
        resources = json.loads(text.replace('\\"', '"'))
        if not isinstance(resources, dict):
            raise ValueError
        return {str(k): float(v) for k, v in resources.items()}
    except (ValueError, TypeError):
        raise InvalidInputError(
            f"{where}.rayStartParams.resources", params.get("resources"), "is not a JSON object of resources",
            'Write e.g. \'"{\\"my-resource\\": 1}"\'',
        ) from None


def _container(template: Mapping[str, Any], resource: str | None = None) -> dict[str, Any]:
    containers = (template.get("spec") or {}).get("containers") or [{}]
    if resource:
        for container in containers:
            if resource in ((container.get("resources") or {}).get("limits") or {}):
                return container
    return containers[0]


def _container_env(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env") or [] if "name" in e and "value" in e}


def _num_cpus(params: Mapping[str, Any], container: Mapping[str, Any], cap: int) -> int:
    if "num-cpus" in params:
        wanted = parse_cpu(params["num-cpus"])
    else:
        limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
        wanted = parse_cpu(limit) if limit is not None else cap
    return max(0, min(cap, math.ceil(wanted)))


def plan_cluster(manifest: Mapping[str, Any], max_hosts: int | None = None) -> LocalPlan:
    """Interpret a RayCluster manifest (from ``build_ray_cluster``) as local Ray nodes.

    The slice shape comes from the manifest's TPU slice annotation and is cross-checked
    against the TPU worker group (replicas, numOfHosts, the ``google.com/tpu`` limit).

    :param manifest: the RayCluster.
    :param max_hosts: refuse clusters with more TPU hosts than this (``replicas x numOfHosts``).
    :raises InvalidInputError: the manifest cannot be emulated here; nothing was started.
    """
    metadata = manifest.get("metadata") or {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not name or not namespace:
        raise InvalidInputError("manifest.metadata", metadata, "lacks a name or namespace",
                                "Render the RayCluster with build_ray_cluster")
    tpu = tpu_slice_of(manifest)
    if tpu is None:
        raise InvalidInputError(
            "manifest", name, "has no TPU slice annotation, so the local backend cannot tell the slice shape",
            "Render the RayCluster with build_ray_cluster(tpu=TpuSlice(...))",
        )
    spec = manifest.get("spec") or {}
    groups = spec.get("workerGroupSpecs") or []
    if len(groups) != 1:
        raise InvalidInputError(
            "spec.workerGroupSpecs", f"{len(groups)} groups", "the local backend emulates exactly one TPU worker group",
            "Render the RayCluster with build_ray_cluster (one worker group of whole slices)",
        )
    group = groups[0]
    replicas = int(group.get("replicas", group.get("minReplicas", 1)))
    hosts = int(group.get("numOfHosts", 1))
    worker = _container(group.get("template") or {}, TPU_RESOURCE)
    chips = ((worker.get("resources") or {}).get("limits") or {}).get(TPU_RESOURCE)
    for field_name, found, expected in (
        ("replicas", replicas, tpu.num_slices),
        ("numOfHosts", hosts, tpu.hosts_per_slice),
        (f"{TPU_RESOURCE} limit", None if chips is None else int(chips), tpu.host_chips),
    ):
        if found != expected:
            raise InvalidInputError(
                f"spec.workerGroupSpecs[0] {field_name}", found,
                f"does not match the TPU slice annotation ({tpu.describe()} wants {expected})",
                "Render the RayCluster with build_ray_cluster and do not edit the worker group by hand",
            )
    total = replicas * hosts
    if max_hosts is not None and total > max_hosts:
        raise InvalidInputError(
            "topology", tpu.topology,
            f"{tpu.describe()} needs {total} TPU hosts (replicas {replicas} x numOfHosts {hosts}), more than "
            f"the local backend emulates on this machine (local_max_hosts={max_hosts})",
            f"Use a smaller topology (at most {max_hosts} hosts of {tpu.host_chips} chips), or raise "
            f"local_max_hosts in the raytpu connection's extra if this machine can run {total + 1} Ray nodes",
        )

    head_group = spec.get("headGroupSpec") or {}
    head_params = head_group.get("rayStartParams") or {}
    head_container = _container(head_group.get("template") or {})
    head = NodeSpec(
        key="head",
        num_cpus=_num_cpus(head_params, head_container, HEAD_MAX_CPUS),
        resources=_ray_param_resources(head_params, "headGroupSpec"),
        env=_container_env(head_container),
    )
    worker_params = group.get("rayStartParams") or {}
    worker_cpus = _num_cpus(worker_params, worker, HOST_MAX_CPUS)
    extra_resources = _ray_param_resources(worker_params, "workerGroupSpecs[0]")
    base_env = _container_env(worker)
    names = tuple(slice_name(name, i) for i in range(replicas))
    slices = []
    for index, slice_ in enumerate(names):
        slice_hosts = []
        for worker_id in range(hosts):
            resources = {
                **extra_resources,
                "TPU": float(tpu.host_chips),
                slice_: 1.0,
                f"accelerator_type:{tpu.ray_accelerator_type}": 1.0,
            }
            if worker_id == 0:
                resources[tpu.head_resource] = 1.0
            slice_hosts.append(
                NodeSpec(
                    key=f"s{index}h{worker_id}",
                    num_cpus=worker_cpus,
                    resources=resources,
                    labels={
                        LABEL_SLICE_NAME: slice_,
                        LABEL_WORKER_ID: str(worker_id),
                        LABEL_TOPOLOGY: tpu.topology,
                        LABEL_POD_TYPE: tpu.pod_type,
                        LABEL_ACCELERATOR_TYPE: tpu.ray_accelerator_type,
                    },
                    env={
                        **base_env,
                        "TPU_NAME": slice_,
                        "TPU_WORKER_ID": str(worker_id),
                        "TPU_ACCELERATOR_TYPE": tpu.pod_type,
                        "TPU_TOPOLOGY": tpu.topology,
                        "JAX_PLATFORMS": "cpu",
                    },
                    slice_index=index,
                    worker_id=worker_id,
                )
            )
        slices.append(tuple(slice_hosts))
    return LocalPlan(
        name=name,
        namespace=namespace,
        tpu=tpu,
        group_name=str(group.get("groupName") or "workers"),
        head=head,
        slices=tuple(slices),
        slice_names=names,
        suspended=bool(spec.get("suspend")),
    )


# -- files and processes ---------------------------------------------------------------------


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never a partial one."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_json(path: Path) -> Any:
    """The file's JSON, or ``None`` when it does not exist (or vanished meanwhile)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def short_temp_root() -> Path:
    """A directory short enough for Ray's unix socket paths (< 108 bytes) under it.

    A socket path is ``<root>/raytpu-<12 hex>/s<i>h<w>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store``,
    about :data:`_SOCKET_PATH_BUDGET` bytes plus the root.
    """
    for candidate in ("/tmp", tempfile.gettempdir()):
        if os.path.isdir(candidate) and len(candidate) + _SOCKET_PATH_BUDGET < UNIX_SOCKET_LIMIT:
            return Path(candidate)
    raise FatalError("The local backend needs /tmp (or a TMPDIR shorter than 15 characters) for Ray's sockets")


_given_ports: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (and not handed out before by this process)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _given_ports:
            _given_ports.add(port)
            return port
    return port


def port_open(port: int, timeout: float = 0.5, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def ray_process_env(marker: str) -> dict[str, str]:
    """The environment of a Ray process started on this machine for one cluster.

    This process's environment without another cluster's address or TPU identity, marked
    with :data:`CLUSTER_MARKER_ENV` = ``marker`` (how the cluster's processes are found
    again), this interpreter first on ``PATH`` (a job's ``python`` is the one Ray runs on,
    as in a Ray image, even from an unactivated venv), no usage stats, and no token
    authentication: the cluster listens on this machine only, and with the mode unset a
    ``~/.ray/auth_token`` (a plain ``ray.init()`` leaves one) would switch it on for
    clients that present none.

    :param marker: the value of :data:`CLUSTER_MARKER_ENV`.
    """
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", CLUSTER_MARKER_ENV: marker})
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
    return env


def process_alive(pid: int | None, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs and is the same process as recorded (not a reused pid, not a zombie).

    :param create_time: what :func:`create_time_of` said when the process was recorded.
    """
    if not pid:
        return False
    import psutil

    try:
        process = psutil.Process(pid)
        if create_time is not None and abs(_since_boot(process) - create_time) > 0.05:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def create_time_of(pid: int) -> float | None:
    """When ``pid`` started, in seconds after boot: unlike psutil's wall-clock create time, a
    clock step (suspend and resume, a restored VM, NTP) does not move it."""
    import psutil

    try:
        return _since_boot(psutil.Process(pid))
    except psutil.Error:
        return None


def _since_boot(process: Any) -> float:
    import psutil

    # psutil adds the kernel's current boot time (wall clock minus uptime) to the start tick.
    return process.create_time() - psutil.boot_time()


def all_processes() -> Iterator[Any]:
    """Fresh ``psutil.Process`` objects for every pid now.

    Not ``psutil.process_iter``: its cache can hold a stale object for a pid that was
    reused meanwhile (pids wrap quickly on a busy machine) and then skips that pid.
    """
    import psutil

    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            yield psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue


def _marker_of(process: Any) -> str | None:
    import psutil

    try:
        return process.environ().get(CLUSTER_MARKER_ENV)
    except (psutil.Error, OSError):
        return None


def _is_marked(marker: str | None, incarnation: str, value_prefix: bool) -> bool:
    return bool(marker) and (marker == incarnation or (value_prefix and marker.startswith(incarnation + "/")))


def marked_processes(incarnation: str, value_prefix: bool = False) -> list[Any]:
    """Every process whose environment carries :data:`CLUSTER_MARKER_ENV` = ``incarnation``.

    Ray daemons that rename themselves (``setproctitle``) overwrite their environment
    block, so this misses them; :func:`cluster_processes` adds the supervisor's session.

    :param incarnation: the marker value (``<incarnation>`` or ``<incarnation>/<node>``).
    :param value_prefix: match markers that start with ``incarnation + "/"`` too.
    """
    return [p for p in all_processes() if _is_marked(_marker_of(p), incarnation, value_prefix)]


def cluster_processes(incarnation: str, session: int | None, session_is_ours: bool) -> tuple[list[Any], bool]:
    """Every process of one cluster incarnation, found without trusting any single pid.

    A process belongs to the cluster if its environment carries the incarnation's marker,
    or if it is in the supervisor's session (the supervisor is a session leader; only Ray
    job drivers leave it, and those keep the marker). The session counts only when it is
    known to be ours: the supervisor (pid + create time) is alive, or a member of the
    session carries the marker (a session id cannot be reused while a member lives).

    :param incarnation: the cluster incarnation (the marker value).
    :param session: the supervisor's pid, which is its session id.
    :param session_is_ours: the session is already known to be ours.
    :return: the processes, and whether the session is (now) known to be ours.
    """
    found: dict[int, Any] = {}
    members: list[Any] = []
    for process in all_processes():
        marked = _is_marked(_marker_of(process), incarnation, value_prefix=True)
        if marked:
            found[process.pid] = process
        if session:
            try:
                in_session = os.getsid(process.pid) == session
            except OSError:
                continue
            if in_session:
                members.append(process)
                session_is_ours = session_is_ours or marked
    if session and session_is_ours:
        found.update({p.pid: p for p in members})
    return list(found.values()), session_is_ours


def kill_processes(processes: list[Any], grace: float) -> None:
    """SIGTERM the processes, wait up to ``grace`` seconds, SIGKILL the rest, reap what is ours."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def tail(path: Path | str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def initial_state(plan: LocalPlan, *, incarnation: str, gcs_port: int, dashboard_port: int,
                  temp_dir: str, state_dir: Path) -> dict[str, Any]:
    """The state the backend writes before starting the supervisor (nothing runs yet)."""

    def host(spec: NodeSpec) -> dict[str, Any]:
        return {
            "key": spec.key, "worker_id": spec.worker_id, "pid": None, "create_time": None, "running": False,
            "ready": False, "node_id": None, "node_manager_port": None, "exit_code": None,
            "message": "waiting for the supervisor", "log": str(state_dir / LOGS_DIR / f"{spec.key}.log"),
            "started_at": None,
        }

    return {
        "version": STATE_VERSION,
        "name": plan.name,
        "namespace": plan.namespace,
        "incarnation": incarnation,
        "phase": "starting",
        "supervisor_pid": None,
        "gcs_address": f"127.0.0.1:{gcs_port}",
        "dashboard_url": f"http://127.0.0.1:{dashboard_port}",
        "temp_dir": temp_dir,
        "suspended": plan.suspended,
        "head": host(plan.head),
        "slices": [
            {"index": i, "name": plan.slice_names[i], "status": "waiting", "message": "waiting for the head",
             "restarts": 0, "failed_starts": 0, "hosts": [host(h) for h in hosts]}
            for i, hosts in enumerate(plan.slices)
        ],
        "failure": None,
        "updated_at": utc_now(),
    }


# -- the supervisor --------------------------------------------------------------------------


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL: Any = None


class Node:
    """A running (or stopped) ``ray start --block`` process for one :class:`NodeSpec`."""

    def __init__(self, spec: NodeSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.create_time: float | None = None
        self.node_manager_port: int | None = None
        self.ready = False
        self.node_id: str | None = None
        self.exit_code: int | None = None
        self.message = "not started"
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        """Whether the process was started and has exited (records the exit code)."""
        if self.proc is None:
            return False
        code = self.proc.poll()
        if code is None:
            return False
        self.exit_code = code
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.spec.key,
            "worker_id": self.spec.worker_id,
            "pid": self.proc.pid if self.proc else None,
            "create_time": self.create_time,
            "running": self.running,
            "ready": self.ready,
            "node_id": self.node_id,
            "node_manager_port": self.node_manager_port,
            "exit_code": self.exit_code,
            "message": self.message,
            "log": str(self.log_path),
            "started_at": self.started_at,
        }


@dataclass
class SliceRun:
    """The hosts of one slice and where its (re)creation stands."""

    index: int
    name: str
    nodes: list[Node]
    status: str = "waiting"
    message: str = "waiting for the head"
    restarts: int = 0
    failed_starts: int = 0
    next_start: float = 0.0
    became_ready: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "name": self.name, "status": self.status, "message": self.message,
            "restarts": self.restarts, "failed_starts": self.failed_starts,
            "hosts": [n.to_dict() for n in self.nodes],
        }


def _backoff(failed_starts: int) -> float:
    return 0.0 if failed_starts <= 0 else min(MAX_BACKOFF_SECONDS, 2.0 ** failed_starts)


class Supervisor:
    """Owns one local RayCluster's Ray processes; see the module docstring.

    :param state_dir: the cluster's state directory (manifest.json, state.json, logs/).
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        manifest = read_json(state_dir / MANIFEST_FILE)
        state = read_json(state_dir / STATE_FILE)
        if manifest is None or state is None:
            raise SystemExit(f"{state_dir} has no {MANIFEST_FILE} or {STATE_FILE}")
        self.plan = plan_cluster(manifest)
        self.incarnation: str = state["incarnation"]
        self.temp_dir = Path(state["temp_dir"])
        self.gcs_port = int(state["gcs_address"].rsplit(":", 1)[1])
        self.dashboard_port = int(state["dashboard_url"].rsplit(":", 1)[1])
        logs = state_dir / LOGS_DIR
        logs.mkdir(exist_ok=True)
        self.head = Node(self.plan.head, logs / "head.log")
        self.head_failed_starts = 0
        self.head_next_start = 0.0
        self.head_dashboard_ok = False
        self.slices = [
            SliceRun(i, self.plan.slice_names[i], [Node(spec, logs / f"{spec.key}.log") for spec in hosts])
            for i, hosts in enumerate(self.plan.slices)
        ]
        self.failure: dict[str, str] | None = None
        self.phase = "starting"
        self.stop_requested = False
        self.gcs: Any = None
        self.last_ready_check = 0.0
        self.last_written: str | None = None
        self.base_env = ray_process_env(self.incarnation)

    # -- state --------------------------------------------------------------------------------

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def publish(self) -> None:
        """Write state.json if anything changed since the last write."""
        state = {
            "version": STATE_VERSION,
            "name": self.plan.name,
            "namespace": self.plan.namespace,
            "incarnation": self.incarnation,
            "phase": self.phase,
            "supervisor_pid": os.getpid(),
            "gcs_address": self.gcs_address,
            "dashboard_url": f"http://127.0.0.1:{self.dashboard_port}",
            "temp_dir": str(self.temp_dir),
            "suspended": self.plan.suspended,
            "head": self.head.to_dict(),
            "slices": [s.to_dict() for s in self.slices],
            "failure": self.failure,
        }
        text = json.dumps(state, sort_keys=True)
        if text == self.last_written:
            return
        try:
            write_json_atomic(self.state_dir / STATE_FILE, {**state, "updated_at": utc_now()})
        except FileNotFoundError:  # the state directory was removed under us; run() stops next
            return
        self.last_written = text

    # -- processes ----------------------------------------------------------------------------

    def _command(self, node: Node) -> list[str]:
        spec = node.spec
        node.node_manager_port = free_port()
        args = [
            sys.executable, "-m", "ray.scripts.scripts", "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={spec.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={self.temp_dir / spec.key}",
            f"--node-manager-port={node.node_manager_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
            "--block",
        ]
        if spec.key == "head":
            args[4:4] = [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={free_port()}",
            ]
        else:
            args[4:4] = [f"--address={self.gcs_address}"]
        if spec.resources:
            args.append(f"--resources={json.dumps(spec.resources, sort_keys=True)}")
        if spec.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec.labels.items())))
        return args

    def start_node(self, node: Node) -> None:
        command = self._command(node)
        env = {**self.base_env, **node.spec.env, CLUSTER_MARKER_ENV: f"{self.incarnation}/{node.spec.key}"}
        node.starts += 1
        with open(node.log_path, "ab") as out:
            out.write(f"\n=== {utc_now()} start #{node.starts}: {' '.join(command[3:])}\n".encode())
            out.flush()
            node.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.state_dir, preexec_fn=_set_parent_death_signal,
            )
        node.create_time = create_time_of(node.proc.pid)
        node.ready, node.node_id, node.exit_code = False, None, None
        node.started_at, node.started_mono = utc_now(), time.monotonic()
        node.message = "starting"
        log.info("started %s (pid %s)", node.spec.key, node.proc.pid)

    def stop_nodes(self, nodes: list[Node], why: str) -> None:
        """Stop the nodes' processes (SIGTERM, then SIGKILL), worker processes included."""
        import psutil

        running = [n for n in nodes if n.proc is not None]
        if not running:
            return
        started = time.monotonic()
        log.info("stopping %s: %s", ", ".join(n.spec.key for n in running), why)
        # Everything these nodes run now (Ray daemons rename themselves, so go by the tree).
        victims: dict[int, Any] = {}
        for node in running:
            assert node.proc is not None
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(node.proc.pid)
                victims.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        # `ray start --block` shuts its node down in order on SIGTERM (raylet, agents, GCS).
        for node in running:
            assert node.proc is not None
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
        deadline = started + STOP_GRACE_SECONDS
        for node in running:
            assert node.proc is not None
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.kill()
                node.proc.wait()
            node.exited()
            node.proc = None
            node.ready = False
        # Whatever of these nodes is left (Ray workers, a daemon that ignored SIGTERM): SIGKILL.
        for node in running:
            victims.update({p.pid: p for p in marked_processes(f"{self.incarnation}/{node.spec.key}")})
        leftovers = []
        for process in victims.values():
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    leftovers.append(process)
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                process.kill()  # psutil checks the create time: never a reused pid
        psutil.wait_procs(leftovers, timeout=5)
        # A raylet that was SIGKILLed cannot unregister; until the GCS's health checks notice,
        # its node would look ALIVE and draw placements. Tell the GCS now.
        self.drain([n.node_id for n in running if n.node_id])
        for node in running:
            node.node_id = None
        log.info("stopped %s in %.1f s (%d leftover processes killed)", ", ".join(n.spec.key for n in running),
                 time.monotonic() - started, len(leftovers))

    def drain(self, node_ids: list[str]) -> None:
        """Mark nodes dead in the GCS (no-op for nodes it already knows are dead)."""
        if not node_ids or self.gcs is None:
            return
        try:
            self.gcs.drain_nodes([bytes.fromhex(i) for i in node_ids], timeout=5)
        except Exception as exc:  # noqa: BLE001 - the health checks will get there anyway
            log.info("could not drain %s in the GCS: %s", node_ids, exc)

    # -- the GCS ------------------------------------------------------------------------------

    def alive_nodes(self) -> dict[int, tuple[str, str]] | None:
        """ALIVE nodes in the GCS: node manager port -> (node id, slice name label).

        ``None`` if the GCS does not answer.
        """
        if self.gcs is None:
            if not port_open(self.gcs_port):
                return None
            from ray._raylet import GcsClient

            try:
                self.gcs = GcsClient(address=self.gcs_address)
            except Exception as exc:  # noqa: BLE001 - any failure means "not reachable yet"
                log.info("GCS at %s not reachable yet: %s", self.gcs_address, exc)
                return None
        try:
            infos = self.gcs.get_all_node_info(timeout=2)
        except Exception as exc:  # noqa: BLE001
            log.info("GCS query failed: %s", exc)
            return None
        return {
            info.node_manager_port: (info.node_id.hex(), info.labels.get(LABEL_SLICE_NAME, ""))
            for info in infos.values()
            if info.state == 0
        }

    def dashboard_ready(self) -> bool:
        base = f"http://127.0.0.1:{self.dashboard_port}"
        for path in ("/api/gcs_healthz", "/api/jobs/"):
            try:
                with urllib.request.urlopen(base + path, timeout=2) as answer:
                    if answer.status != 200:
                        return False
            except (urllib.error.URLError, OSError, ValueError):
                return False
        return True

    # -- reconciliation -----------------------------------------------------------------------

    def fail(self, reason: str, message: str) -> None:
        log.error("%s: %s", reason, message)
        self.failure = {"reason": reason, "message": message}

    def head_down(self, why: str) -> None:
        """The head is gone: stop everything; it all starts again after a backoff."""
        ever_ready = self.head.ready
        self.head.ready, self.head.message = False, why
        for node in (n for s in self.slices for n in s.nodes):
            node.ready = False
        self.publish()  # watchers see the cluster leave READY before the (slow) stop
        self.gcs = None  # the GCS went with the head: nothing to tell it
        self.stop_nodes([n for s in self.slices for n in s.nodes] + [self.head], why)
        self.head.message = why
        self.head_dashboard_ok = False
        self.head_failed_starts = 0 if ever_ready else self.head_failed_starts + 1
        for run in self.slices:
            if run.status != "failed":
                run.status, run.message, run.next_start = "waiting", f"waiting for the head ({why})", 0.0
        if self.head_failed_starts >= MAX_FAILED_STARTS:
            self.fail("HeadFailed", f"the Ray head failed to start {self.head_failed_starts} times; last: {why}. "
                                    f"Log: {self.head.log_path}")
            return
        self.head_next_start = time.monotonic() + _backoff(self.head_failed_starts)
        if self.head_failed_starts:
            # A port may have been taken meanwhile: try fresh ones.
            self.gcs_port, self.dashboard_port = free_port(), free_port()

    def slice_down(self, run: SliceRun, why: str) -> None:
        """One host of the slice is gone: stop all its hosts and recreate the whole slice."""
        if run.became_ready:
            run.restarts += 1
        run.failed_starts = 0 if run.became_ready else run.failed_starts + 1
        run.status, run.message, run.became_ready = "restarting", f"{why}; recreating the whole slice", False
        for node in run.nodes:
            node.ready = False
            node.message = why if node.exited() else "stopped to recreate its slice"
        self.publish()  # watchers see the slice leave READY before the (slow) stop
        self.stop_nodes(run.nodes, why)
        if run.failed_starts >= MAX_FAILED_STARTS:
            run.status = "failed"
            run.message = f"failed to start {run.failed_starts} times; last: {why}"
            self.fail("SliceFailed", f"slice {run.index} ({run.name}) {run.message}. Logs: "
                                     + ", ".join(str(n.log_path) for n in run.nodes))
            return
        run.next_start = time.monotonic() + _backoff(run.failed_starts)

    def reconcile(self) -> None:
        now = time.monotonic()
        if self.plan.suspended or self.head_failed_starts >= MAX_FAILED_STARTS:
            return
        head = self.head
        if head.proc is None:
            if now >= self.head_next_start:
                self.start_node(head)
            return
        if head.exited():
            self.head_down(f"the head's ray start exited with code {head.exit_code}")
            return
        alive: dict[int, tuple[str, str]] | None = None
        if not head.ready or now - self.last_ready_check >= READY_CHECK_SECONDS or any(
            not n.ready for s in self.slices for n in s.nodes if n.proc is not None
        ):
            alive = self.alive_nodes()
            self.last_ready_check = now
        if not head.ready:
            if alive and head.node_manager_port in alive and (self.head_dashboard_ok or self.dashboard_ready()):
                head.ready, head.node_id, head.message = True, alive[head.node_manager_port][0], "ready"
                self.head_dashboard_ok = True
                self.phase = "running"
                log.info("head ready (GCS %s)", self.gcs_address)
            elif now - head.started_mono > START_TIMEOUT_SECONDS:
                self.head_down(f"the head was not ready within {START_TIMEOUT_SECONDS:.0f} s")
                return
            else:
                head.message = "starting" if alive is None else "waiting for the GCS and dashboard"
                return
        elif alive is not None and head.node_manager_port not in alive:
            self.head_down("the head's raylet is no longer alive in the GCS")
            return

        for run in self.slices:
            if run.status == "failed":
                continue
            if all(n.proc is None for n in run.nodes):
                if now >= run.next_start:
                    for node in run.nodes:  # all hosts of a slice in parallel
                        self.start_node(node)
                    run.status, run.message = "starting", f"starting {len(run.nodes)} hosts"
                continue
            gone = [n for n in run.nodes if n.exited()]
            if gone:
                first = gone[0]
                self.slice_down(run, f"host {first.spec.worker_id} exited with code {first.exit_code}")
                continue
            if alive is None:
                continue
            lost = [n for n in run.nodes if n.ready and n.node_manager_port not in alive]
            if lost:
                self.slice_down(run, f"host {lost[0].spec.worker_id}'s raylet is no longer alive in the GCS")
                continue
            for node in run.nodes:
                if not node.ready and node.node_manager_port in alive:
                    node.ready, node.node_id, node.message = True, alive[node.node_manager_port][0], "ready"
            ours = {n.node_manager_port for n in run.nodes}
            stale = [node_id for port, (node_id, slice_) in alive.items() if slice_ == run.name and port not in ours]
            if stale:
                # An earlier incarnation of this slice still looks alive: not ready until the GCS drops it.
                self.drain(stale)
                run.message = f"waiting for the GCS to drop {len(stale)} dead host(s) of the previous slice"
                for node in run.nodes:
                    if node.ready:
                        node.ready, node.message = False, "registered; " + run.message
            if not stale and all(n.ready for n in run.nodes):
                if run.status != "ready":
                    log.info("slice %s ready", run.name)
                run.status, run.message, run.became_ready, run.failed_starts = "ready", "ready", True, 0
            elif now - min(n.started_mono for n in run.nodes) > START_TIMEOUT_SECONDS:
                self.slice_down(run, f"not all hosts were ready within {START_TIMEOUT_SECONDS:.0f} s")

    # -- main loop ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def run(self) -> int:
        global _PRCTL
        _PRCTL = _load_prctl()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)
        log.info("supervising RayCluster %s/%s (incarnation %s, %d TPU hosts, temp dir %s)",
                 self.plan.namespace, self.plan.name, self.incarnation, self.plan.total_hosts, self.temp_dir)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.publish()
        try:
            while not self.stop_requested:
                if not self.state_dir.is_dir():
                    log.warning("state directory %s is gone; stopping", self.state_dir)
                    break
                self.reconcile()
                self.publish()
                time.sleep(POLL_SECONDS)
        except Exception:
            log.exception("supervisor failed")
            raise
        finally:
            self.phase = "stopping"
            with contextlib.suppress(Exception):
                self.publish()
            self.stop_nodes([n for s in self.slices for n in s.nodes] + [self.head], "supervisor stopping")
            self.phase = "stopped"
            with contextlib.suppress(Exception):
                self.publish()
            if not self.state_dir.is_dir():  # nobody will clean up after an orphaned cluster
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            log.info("stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {__spec__.name if __spec__ else 'local_supervisor'} <state-dir>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    return Supervisor(Path(args[0]).resolve()).run()


if __name__ == "__main__":
    sys.exit(main())
