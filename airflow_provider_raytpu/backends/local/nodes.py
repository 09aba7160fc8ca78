"""The Ray processes of a local cluster: one ``ray start --block`` per node, and one slice's hosts together.

Used by the supervisor (:mod:`airflow_provider_raytpu.backends.local.supervisor`) only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.plan import NodeSpec
from airflow_provider_raytpu.backends.local.process import (
    create_time_of,
    free_port,
    is_running,
    marked_processes,
    utc_now,
)

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 150 * 1024 * 1024
STOP_GRACE_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 30.0
#: Hosts starting at once; the next starts when one's raylet is ALIVE. A raylet gives its dashboard agent 15 s
#: and then aborts (Ray issue 65983): four agents importing together on 2 busy cores missed it, and retried together.
PARALLEL_STARTS = int(os.environ.get("RAYTPU_LOCAL_PARALLEL_STARTS", str(max(1, (os.cpu_count() or 2) // 2))))

_PRCTL: Any = None


def enable_parent_death_signal() -> None:
    """Make every node started from now on get SIGTERM when this process dies (Linux only)."""
    global _PRCTL
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _PRCTL = None


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def hosts_to_start(slice_hosts: list[Node], cluster_hosts: list[Node]) -> list[Node]:
    """The slice's hosts to start now: those not running, while fewer than :data:`PARALLEL_STARTS` hosts of the
    cluster are starting (running, their raylet not yet ALIVE)."""
    starting = sum(1 for n in cluster_hosts if n.starting)
    return [n for n in slice_hosts if n.proc is None][:max(0, PARALLEL_STARTS - starting)]


def backoff(failed_starts: int) -> float:
    """Seconds to wait before starting again after ``failed_starts`` failed starts in a row."""
    return 0.0 if failed_starts <= 0 else min(MAX_BACKOFF_SECONDS, 2.0 ** failed_starts)


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
    def starting(self) -> bool:
        """Started, its raylet not yet ALIVE in the GCS."""
        return self.proc is not None and not self.ready

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

    def command(self, *, temp_dir: Path, gcs_port: int, dashboard_port: int) -> list[str]:
        """``ray start`` for this node, on fresh ports; the head serves the GCS and the dashboard."""
        spec = self.spec
        self.node_manager_port = free_port()
        args = [
            sys.executable, "-m", "ray.scripts.scripts", "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={spec.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={temp_dir / spec.key}",
            f"--node-manager-port={self.node_manager_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
            "--block",
        ]
        if spec.key == "head":
            args[4:4] = [
                "--head",
                f"--port={gcs_port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}",
                f"--ray-client-server-port={free_port()}",
            ]
        else:
            args[4:4] = [f"--address=127.0.0.1:{gcs_port}"]
        if spec.resources:
            args.append(f"--resources={json.dumps(spec.resources, sort_keys=True)}")
        if spec.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec.labels.items())))
        return args

    def start(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        """Start ``command`` with its output appended to the node's log."""
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {utc_now()} start #{self.starts}: {' '.join(command[3:])}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=cwd, preexec_fn=_set_parent_death_signal,
            )
        self.create_time = create_time_of(self.proc.pid)
        self.ready, self.node_id, self.exit_code = False, None, None
        self.started_at, self.started_mono = utc_now(), time.monotonic()
        self.message = "starting"
        log.info("started %s (pid %s)", self.spec.key, self.proc.pid)

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


def first_ready(ready_at: str | None, head: Node, slices: list[SliceRun]) -> str | None:
    """When the cluster was first ready (its head and every slice), as KubeRay's ``stateTransitionTimes.ready``:
    ``ready_at`` once it is known, else now if it is ready now, else ``None``."""
    if ready_at is None and head.ready and all(s.status == "ready" for s in slices):
        return utc_now()
    return ready_at


def stop_nodes(nodes: list[Node], incarnation: str, why: str) -> list[Node]:
    """Stop the nodes' processes (SIGTERM, then SIGKILL), their Ray workers included.

    :param incarnation: the cluster incarnation (each node's marker is ``<incarnation>/<key>``).
    :return: the nodes that were running (now stopped, not ready; their ``node_id`` kept).
    """
    import psutil

    running = [n for n in nodes if n.proc is not None]
    if not running:
        return []
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
        victims.update({p.pid: p for p in marked_processes(f"{incarnation}/{node.spec.key}")})
    leftovers = [process for process in victims.values() if is_running(process)]
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()  # psutil checks the create time: never a reused pid
    psutil.wait_procs(leftovers, timeout=5)
    log.info("stopped %s in %.1f s (%d leftover processes killed)", ", ".join(n.spec.key for n in running),
             time.monotonic() - started, len(leftovers))
    return running
