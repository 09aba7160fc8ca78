"""Processes and files of the local backend: who is running, atomic JSON state, ports, locks, logs.

A process is recognised by its pid AND its start in seconds after boot (a reused pid or a
wall-clock step cannot fool it), and a cluster's processes by an environment marker plus the
supervisor's session (:func:`cluster_processes`). Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil

CLUSTER_MARKER_ENV = "RAYTPU_LOCAL_CLUSTER"

# Environment a node must not inherit from whoever started the supervisor.
_SCRUBBED_ENV = ("RAY_ADDRESS", "TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
                 "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS")
# What a local cluster takes from the Airflow worker's environment: what Python, Ray, JAX and the
# storage libraries read. Never Airflow's connections, variables or configuration (AIRFLOW_CONN_*,
# AIRFLOW__*): anyone who reaches the head's dashboard, which has no authentication, runs code there.
# A job gets anything else through its runtime_env, a cluster through its options' env.
_PASSED_ENV = re.compile(
    r"PATH|HOME|USER|LOGNAME|SHELL|TERM|LANG|LANGUAGE|TZ|TMPDIR|TEMP|TMP|VIRTUAL_ENV|LD_LIBRARY_PATH"
    r"|OMP_NUM_THREADS|SSL_CERT_FILE|SSL_CERT_DIR|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE"
    r"|(HTTPS?|NO|ALL)_PROXY|(https?|no|all)_proxy|STORAGE_EMULATOR_HOST|GOOGLE_CLOUD_PROJECT"
    r"|GOOGLE_APPLICATION_CREDENTIALS|(LC|PYTHON|RAY|JAX|XLA|LIBTPU|TENSORSTORE|GCSFS|CLOUDSDK|HF)_?\w*"
)


def passed_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The part of ``environ`` (default: this process's) a local cluster's processes get (see ``_PASSED_ENV``)."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if _PASSED_ENV.fullmatch(k) and k not in _SCRUBBED_ENV}


# -- files -----------------------------------------------------------------------------------


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


@contextlib.contextmanager
def file_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing), across processes.

    :param wait: block until the lock is free; with ``False`` yield ``False`` at once when
        another holder has it (and hold nothing).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


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


# -- ports -----------------------------------------------------------------------------------

_given_ports: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (and not handed out before by this process)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _given_ports:
            _given_ports.add(port)
            return port
    return port


def port_open(port: int, timeout: float = 0.5, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def port_if_free(address: str | None, fallback: int) -> int:
    """The port of ``address`` (``host:port`` or a URL) if it can be bound on 127.0.0.1 now, else ``fallback``."""
    if not address:
        return fallback
    try:
        port = int(str(address).rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As Ray's servers bind (aiohttp and gRPC set it): a port whose old connections linger is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
        return port
    except (ValueError, IndexError, OSError):
        return fallback


# -- processes -------------------------------------------------------------------------------


def ray_process_env(marker: str) -> dict[str, str]:
    """The environment of a Ray process started on this machine for one cluster.

    What this process's environment passes on (:func:`passed_env`: not Airflow's connections or
    configuration), without another cluster's address or TPU identity, marked
    with :data:`CLUSTER_MARKER_ENV` = ``marker`` (how the cluster's processes are found
    again), this interpreter first on ``PATH`` (a job's ``python`` is the one Ray runs on,
    as in a Ray image, even from an unactivated venv), no usage stats, and no token
    authentication: the cluster listens on this machine only, and with the mode unset a
    ``~/.ray/auth_token`` (a plain ``ray.init()`` leaves one) would switch it on for
    clients that present none.

    :param marker: the value of :data:`CLUSTER_MARKER_ENV`.
    """
    env = passed_env()
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


def _since_boot(process: psutil.Process) -> float:
    import psutil

    # psutil adds the kernel's current boot time (wall clock minus uptime) to the start tick.
    return process.create_time() - psutil.boot_time()


def is_running(process: psutil.Process) -> bool:
    """Whether a ``psutil.Process`` still runs (a zombie does not)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


def _marker_of(process: psutil.Process) -> str | None:
    import psutil

    try:
        return process.environ().get(CLUSTER_MARKER_ENV)
    except (psutil.Error, OSError):
        return None


def _is_marked(marker: str | None, incarnation: str, value_prefix: bool) -> bool:
    if not marker:
        return False
    return marker == incarnation or (value_prefix and marker.startswith(incarnation + "/"))


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
