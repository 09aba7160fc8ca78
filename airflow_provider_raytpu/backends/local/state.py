"""What the local backend records on disk, where, and in which form.

Under the home (the connection's ``local_home``, else ``$RAYTPU_HOME``, else
``~/.raytpu``) a RayCluster is ``clusters/<namespace>/<name>/`` and a RayService
``services/<namespace>/<name>/``. A cluster's directory holds ``manifest.json`` (the
RayCluster as KubeRay would get it, no status), ``supervisor.json`` (the backend's record of
the supervisor: pid, create time, incarnation), ``supervisor.log``, ``logs/`` (one per Ray
node) and ``state.json``, written by the supervisor (the contract; version 1)::

    {"version": 1, "name", "namespace", "incarnation", "phase": starting|running|stopping|stopped,
     "supervisor_pid", "gcs_address", "dashboard_url", "temp_dir", "suspended",
     "head": HOST, "slices": [{"index", "name", "status": waiting|starting|ready|restarting|failed,
                               "message", "restarts", "failed_starts", "hosts": [HOST, ...]}],
     "failure": null | {"reason", "message"}, "updated_at"}
    HOST = {"key", "worker_id", "pid", "create_time", "running", "ready", "node_id",
            "node_manager_port", "exit_code", "message", "log", "started_at"}
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.backends.local.plan import LocalPlan, NodeSpec
from airflow_provider_raytpu.backends.local.process import process_alive, read_json, utc_now
from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.manifests.names import RAY_SERVICE_NAME_LIMIT, resource_name

if TYPE_CHECKING:
    from airflow_provider_raytpu.connection import ConnectionSettings

STATE_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
SUPERVISOR_FILE = "supervisor.json"
SUPERVISOR_LOG = "supervisor.log"
LOGS_DIR = "logs"
TEMP_DIR_PREFIX = "raytpu-"
CLUSTERS_DIR = "clusters"
SERVICES_DIR = "services"
DEFAULT_HOME = "~/.raytpu"
HOME_ENV = "RAYTPU_HOME"
POLL_SECONDS = 0.5  # how often the supervisor looks at its processes and publishes state.json
UNIX_SOCKET_LIMIT = 108
# "/raytpu-<12 hex>" + "/s99h99" + "/session_2026-12-02_16-24-34_486778_4194304" + "/sockets/plasma_store"
_SOCKET_PATH_BUDGET = 20 + 7 + 44 + 21
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


# -- where -----------------------------------------------------------------------------------


def local_home(settings: ConnectionSettings) -> Path:
    """Where local clusters are recorded: ``local_home``, else ``$RAYTPU_HOME``, else ``~/.raytpu``."""
    text = settings.local_home or os.environ.get(HOME_ENV) or DEFAULT_HOME
    return Path(os.path.abspath(os.path.expanduser(text)))


def check_name(value: str, field: str) -> str:
    """``value`` if it is a Kubernetes name (a DNS label), else an error naming ``field``."""
    if not isinstance(value, str) or not _DNS_LABEL.match(value):
        raise InvalidInputError(
            field, value, "is not a Kubernetes name", "Use lower-case letters, digits and '-' (at most 63)"
        )
    return value


def cluster_dir(home: Path, name: str, namespace: str) -> Path:
    """A RayCluster's state directory (whether or not it exists); both names are checked."""
    return home / CLUSTERS_DIR / check_name(namespace, "namespace") / check_name(name, "cluster_name")


def services_dir(home: Path, namespace: str) -> Path:
    """The directory of a namespace's RayServices (whether or not it exists)."""
    return home / SERVICES_DIR / resource_name(namespace, "namespace", 63)


def service_dir(home: Path, name: str, namespace: str) -> Path:
    """A RayService's directory (whether or not it exists); both names are checked."""
    return services_dir(home, namespace) / resource_name(name, "service_name", RAY_SERVICE_NAME_LIMIT)


def home_of(cluster_path: Path) -> Path:
    """The home a cluster's state directory (:func:`cluster_dir`) is in."""
    return cluster_path.parents[2]


def short_temp_root() -> Path:
    """A directory short enough for Ray's unix socket paths (< 108 bytes) under it.

    A socket path is ``<root>/raytpu-<12 hex>/s<i>h<w>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store``,
    about :data:`_SOCKET_PATH_BUDGET` bytes plus the root.
    """
    for candidate in ("/tmp", tempfile.gettempdir()):
        if os.path.isdir(candidate) and len(candidate) + _SOCKET_PATH_BUDGET < UNIX_SOCKET_LIMIT:
            return Path(candidate)
    raise FatalError("The local backend needs /tmp (or a TMPDIR shorter than 15 characters) for Ray's sockets")


# -- what ------------------------------------------------------------------------------------


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

    @classmethod
    def read(cls, path: Path) -> StoredCluster | None:
        """The cluster recorded in ``path``; ``None`` when it has no manifest (absent, or half created)."""
        manifest = read_json(path / MANIFEST_FILE)
        if manifest is None:
            return None
        return cls(path, manifest, read_json(path / STATE_FILE), read_json(path / SUPERVISOR_FILE))

    @property
    def supervisor_alive(self) -> bool:
        sup = self.supervisor or {}
        return process_alive(sup.get("pid"), sup.get("create_time"))

    @property
    def deleting(self) -> bool:
        return bool(self.manifest.get("metadata", {}).get("deletionTimestamp"))


def next_version(stored: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``stored`` whose ``metadata.resourceVersion`` is one higher: every write of a stored object
    raises it, so a :class:`~airflow_provider_raytpu.backends.base.Precondition` on a version sees the write."""
    metadata = stored.get("metadata") or {}
    return {**stored, "metadata": {**metadata, "resourceVersion": str(int(metadata.get("resourceVersion") or 0) + 1)}}


def stored_form(manifest: dict[str, Any], existing: dict[str, Any] | None, *, changed: bool = True) -> dict[str, Any]:
    """A RayCluster or RayService as stored: server-like metadata added (merged over an existing one on update).

    :param existing: the stored object it replaces, if any.
    :param changed: whether the spec changed (a new ``generation``).
    """
    stored = copy.deepcopy({k: v for k, v in manifest.items() if k != "status"})
    metadata = stored.setdefault("metadata", {})
    if existing is None:
        metadata.update({"uid": str(uuid.uuid4()), "creationTimestamp": utc_now(), "generation": 1,
                         "resourceVersion": "1"})
    else:
        old = existing.get("metadata", {})
        metadata.update({
            "uid": old.get("uid", str(uuid.uuid4())),
            "resourceVersion": next_version(existing)["metadata"]["resourceVersion"],
            "creationTimestamp": old.get("creationTimestamp", utc_now()),
            "generation": int(old.get("generation", 1)) + (1 if changed else 0),
            "labels": {**(old.get("labels") or {}), **(metadata.get("labels") or {})},
            "annotations": {**(old.get("annotations") or {}), **(metadata.get("annotations") or {})},
        })
    return stored


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
