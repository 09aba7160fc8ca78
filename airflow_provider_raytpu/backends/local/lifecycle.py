"""Start a local cluster's supervisor, and stop exactly that cluster's processes.

The supervisor (:mod:`airflow_provider_raytpu.backends.local.supervisor`) is started
detached, a session leader, so the cluster outlives the task that made it. Callers hold the
cluster's lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.plan import plan_cluster
from airflow_provider_raytpu.backends.local.process import (
    CLUSTER_MARKER_ENV,
    cluster_processes,
    create_time_of,
    free_port,
    is_running,
    kill_processes,
    passed_env,
    port_if_free,
    utc_now,
    write_json_atomic,
)
from airflow_provider_raytpu.backends.local.state import (
    LOGS_DIR,
    MANIFEST_FILE,
    STATE_FILE,
    SUPERVISOR_FILE,
    SUPERVISOR_LOG,
    TEMP_DIR_PREFIX,
    StoredCluster,
    initial_state,
    short_temp_root,
)

SUPERVISOR_MODULE = "airflow_provider_raytpu.backends.local.supervisor"
STOP_TIMEOUT_SECONDS = 45.0


def start_cluster(path: Path, manifest: dict[str, Any], *, fresh: bool, previous: dict[str, Any] | None = None) -> None:
    """Write the manifest and a fresh state into ``path``, then start a supervisor for it.

    :param path: the cluster's state directory.
    :param manifest: the RayCluster as stored.
    :param fresh: remove whatever ``path`` holds first.
    :param previous: the state of the incarnation this one replaces; its ports are kept when free,
        so references (the dashboard URL, the GCS address) stay valid.
    """
    plan = plan_cluster(manifest)
    if fresh and path.exists():
        shutil.rmtree(path)
    (path / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    incarnation = uuid.uuid4().hex[:12]
    gcs_port, dashboard_port = free_port(), free_port()
    if previous:
        gcs_port = port_if_free(previous.get("gcs_address"), gcs_port)
        dashboard_port = port_if_free(previous.get("dashboard_url"), dashboard_port)
    temp_dir = short_temp_root() / f"{TEMP_DIR_PREFIX}{incarnation}"
    state = initial_state(plan, incarnation=incarnation, gcs_port=gcs_port, dashboard_port=dashboard_port,
                          temp_dir=str(temp_dir), state_dir=path)
    with contextlib.suppress(FileNotFoundError):
        (path / SUPERVISOR_FILE).unlink()
    write_json_atomic(path / STATE_FILE, state)
    write_json_atomic(path / MANIFEST_FILE, manifest)
    env = passed_env()
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


def processes_of(stored: StoredCluster, session_is_ours: bool) -> tuple[list[Any], bool]:
    """Every process of the cluster's recorded incarnations (see
    :func:`~airflow_provider_raytpu.backends.local.process.cluster_processes`), and whether
    the supervisor's session is known to be ours."""
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


def stop_cluster(stored: StoredCluster) -> None:
    """Stop exactly this cluster's processes: its supervisor (which stops its Ray nodes), then any rest.

    Never ``ray stop``: other Ray clusters on the machine are left alone. The rest is
    found by :func:`processes_of` (the incarnation's environment marker and the
    supervisor's session).
    """
    import psutil

    sup = stored.supervisor or {}
    alive = stored.supervisor_alive
    snapshot, verified = processes_of(stored, alive)  # before the supervisor is gone
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
        found, verified = processes_of(stored, verified)
        remaining = [p for p in {**{p.pid: p for p in snapshot}, **{p.pid: p for p in found}}.values()
                     if is_running(p)]
        snapshot = []
        if not remaining:
            return
        kill_processes(remaining, 3.0)


def remove_cluster(stored: StoredCluster) -> None:
    """Remove the cluster's state directory and its Ray temp dir."""
    temp_dir = (stored.state or {}).get("temp_dir")
    if temp_dir and Path(temp_dir).name.startswith(TEMP_DIR_PREFIX):
        shutil.rmtree(temp_dir, ignore_errors=True)
    shutil.rmtree(stored.path, ignore_errors=True)
