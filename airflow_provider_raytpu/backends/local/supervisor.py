"""The per-cluster supervisor of the ``local`` backend: a Ray head plus one raylet per TPU host.

Run as ``python -m airflow_provider_raytpu.backends.local.supervisor <state-dir>``; the
backend (:mod:`airflow_provider_raytpu.backends.local.lifecycle`) starts it detached, so a
cluster outlives the Airflow task that made it. The supervisor

- reads ``manifest.json`` (the RayCluster as KubeRay would get it) and the initial
  ``state.json`` (ports, temp dir, incarnation) from its state directory;
- starts ``ray start --head --block`` and, once the head is registered in the GCS and
  its dashboard answers, one ``ray start --address=... --block`` per TPU host, the hosts
  of a slice in parallel, each as :func:`~airflow_provider_raytpu.backends.local.plan.plan_cluster`
  plans it (so Ray's own TPU placement works on the emulated slice);
- like KubeRay with multi-host indexing, recreates a WHOLE slice when one of its hosts
  dies (stops the survivors, starts every host again); a dead head recreates everything;
- publishes what it sees to ``state.json`` (atomically, only when it changes; the contract is
  in :mod:`airflow_provider_raytpu.backends.local.state`); a host is ready only once its
  raylet is registered ALIVE in the GCS (one cheap ``GcsClient`` call);
- for the cluster of a RayService, stands in for KubeRay's RayService controller: while the
  head runs, it PUTs the service's Serve config whenever Serve lacks it (a restarted head
  starts with an empty Serve; :mod:`airflow_provider_raytpu.backends.local.serve_sync`);
- stops its processes and exits by itself when nobody can use them any more
  (:mod:`airflow_provider_raytpu.backends.local.stop_reasons`), so a lost cluster does not run
  on until someone deletes it;
- on SIGTERM stops exactly its own processes and exits. It is a session leader and every process it starts
  inherits the environment variable :data:`~airflow_provider_raytpu.backends.local.process.CLUSTER_MARKER_ENV`
  = the cluster's incarnation; together (Ray daemons overwrite their environment when they rename themselves,
  Ray job drivers leave the session) they let the backend find all of its processes and nothing else. Its
  ``ray start`` children get SIGTERM if the supervisor itself dies.

Two knobs, read from the environment of the process that applies the cluster (the
supervisor inherits it): ``RAYTPU_LOCAL_START_TIMEOUT`` (seconds a node may take to
register, default 180) and ``RAYTPU_LOCAL_MAX_FAILED_STARTS`` (failed starts in a row
before the head or a slice is FAILED, default 3). Ray is imported only for ``GcsClient``,
once the head runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.gcs import Gcs, dashboard_ready
from airflow_provider_raytpu.backends.local.nodes import (
    Node,
    SliceRun,
    backoff,
    enable_parent_death_signal,
    first_ready,
    hosts_to_start,
    stop_nodes,
)
from airflow_provider_raytpu.backends.local.plan import plan_cluster
from airflow_provider_raytpu.backends.local.process import (
    CLUSTER_MARKER_ENV,
    free_port,
    port_if_free,
    ray_process_env,
    read_json,
    utc_now,
    write_json_atomic,
)
from airflow_provider_raytpu.backends.local.serve_sync import keep_serve_config, service_dir_of
from airflow_provider_raytpu.backends.local.state import (
    LOGS_DIR,
    MANIFEST_FILE,
    POLL_SECONDS,
    STATE_FILE,
    STATE_VERSION,
)
from airflow_provider_raytpu.backends.local.stop_reasons import StopReasons, expiry_of
from airflow_provider_raytpu.dashboard.transport import DirectTransport
from airflow_provider_raytpu.values import plural

log = logging.getLogger("airflow_provider_raytpu.local_supervisor")

READY_CHECK_SECONDS = 2.0
START_TIMEOUT_SECONDS = float(os.environ.get("RAYTPU_LOCAL_START_TIMEOUT", "180"))
MAX_FAILED_STARTS = int(os.environ.get("RAYTPU_LOCAL_MAX_FAILED_STARTS", "3"))
SERVE_CHECK_SECONDS = 5.0


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
        self.head_failed_starts, self.head_next_start, self.head_dashboard_ok = 0, 0.0, False
        self.ready_at: str | None = state.get("ready_at")
        self.slices = [SliceRun(i, self.plan.slice_names[i], [Node(spec, logs / f"{spec.key}.log") for spec in hosts])
                       for i, hosts in enumerate(self.plan.slices)]
        self.failure: dict[str, str] | None = None
        self.phase = "starting"
        self.stop_requested = False
        self.gcs = Gcs()
        self.last_ready_check = 0.0
        self.last_written: str | None = None
        self.base_env = ray_process_env(self.incarnation)
        self.service_dir = service_dir_of(state_dir, manifest)
        self.serve_check: threading.Thread | None = None
        self.next_serve_check = 0.0
        self.stop_reasons = StopReasons(state_dir, self.incarnation, expiry_of(manifest))

    # -- state --------------------------------------------------------------------------------

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def publish(self) -> None:
        """Write state.json if anything changed since the last write."""
        self.ready_at = first_ready(self.ready_at, self.head, self.slices)
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
            "ready_at": self.ready_at,
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

    def start_node(self, node: Node) -> None:
        command = node.command(temp_dir=self.temp_dir, gcs_port=self.gcs_port, dashboard_port=self.dashboard_port)
        marker = f"{self.incarnation}/{node.spec.key}"
        node.start(command, {**self.base_env, **node.spec.env, CLUSTER_MARKER_ENV: marker}, self.state_dir)

    def stop_nodes(self, nodes: list[Node], why: str) -> None:
        """Stop the nodes' processes, then tell the GCS they are gone."""
        stopped = stop_nodes(nodes, self.incarnation, why)
        # A raylet that was SIGKILLed cannot unregister; until the GCS's health checks notice,
        # its node would look ALIVE and draw placements. Tell the GCS now.
        self.gcs.drain([n.node_id for n in stopped if n.node_id])
        for node in stopped:
            node.node_id = None

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
        self.gcs.forget()  # the GCS went with the head: nothing to tell it
        self.next_serve_check = 0.0  # a new head starts with an empty Serve
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
        self.head_next_start = time.monotonic() + backoff(self.head_failed_starts)
        if self.head_failed_starts:  # a port taken meanwhile is replaced; a free one is kept, so that the
            # dashboard links already on the task pages still answer
            self.gcs_port = port_if_free(f"127.0.0.1:{self.gcs_port}", free_port())
            self.dashboard_port = port_if_free(f"127.0.0.1:{self.dashboard_port}", free_port())

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
        run.next_start = time.monotonic() + backoff(run.failed_starts)

    def reconcile(self) -> None:
        """One pass: the head's process, then whether the head is ready, then (with a ready head) each slice."""
        if self.plan.suspended or self.head_failed_starts >= MAX_FAILED_STARTS:
            return
        now = time.monotonic()
        if not self._head_runs(now):
            return
        alive = self._alive_raylets(now)
        if not self._head_ready(now, alive):
            return
        for run in self.slices:
            if run.status != "failed":
                self._reconcile_slice(run, now, alive)

    def _head_runs(self, now: float) -> bool:
        """Start the head when it is due; a head whose ``ray start`` exited takes the cluster down."""
        if self.head.proc is None:
            if now >= self.head_next_start:
                self.start_node(self.head)
            return False
        if self.head.exited():
            self.head_down(f"the head's ray start exited with code {self.head.exit_code}")
            return False
        return True

    def _alive_raylets(self, now: float) -> dict[int, tuple[str, str]] | None:
        """The GCS's ALIVE raylets by node manager port: read while a node is starting, else every
        :data:`READY_CHECK_SECONDS`; ``None`` between reads."""
        starting = any(n.starting for s in self.slices for n in s.nodes)
        if self.head.ready and not starting and now - self.last_ready_check < READY_CHECK_SECONDS:
            return None
        self.last_ready_check = now
        return self.gcs.alive_nodes(self.gcs_port)

    def _head_ready(self, now: float, alive: dict[int, tuple[str, str]] | None) -> bool:
        """Whether the head is ready: its raylet ALIVE in the GCS and its dashboard answering once."""
        head = self.head
        if head.ready:
            if alive is not None and head.node_manager_port not in alive:
                self.head_down("the head's raylet is no longer alive in the GCS")
                return False
            return True
        if alive and head.node_manager_port in alive and (
            self.head_dashboard_ok or dashboard_ready(self.dashboard_port)
        ):
            head.ready, head.node_id, head.message = True, alive[head.node_manager_port][0], "ready"
            self.head_dashboard_ok = True
            self.phase = "running"
            log.info("head ready (GCS %s)", self.gcs_address)
            return True
        if now - head.started_mono > START_TIMEOUT_SECONDS:
            self.head_down(f"the head was not ready within {START_TIMEOUT_SECONDS:.0f} s")
        else:
            head.message = "starting" if alive is None else "waiting for the GCS and dashboard"
        return False

    def _reconcile_slice(self, run: SliceRun, now: float, alive: dict[int, tuple[str, str]] | None) -> None:
        """Start a stopped slice when due; recreate it whole when a host is gone; mark it ready when every
        host is registered and no host of its previous incarnation is left in the GCS."""
        if all(n.proc is None for n in run.nodes):
            if now < run.next_start:
                return
            run.status, run.message = "starting", f"starting {plural(len(run.nodes), 'host')}"
        for node in hosts_to_start(run.nodes, [n for s in self.slices for n in s.nodes]):
            self.start_node(node)
        if gone := [n for n in run.nodes if n.exited()]:
            self.slice_down(run, f"host {gone[0].spec.worker_id} exited with code {gone[0].exit_code}")
            return
        if alive is None:
            return
        if lost := [n for n in run.nodes if n.ready and n.node_manager_port not in alive]:
            self.slice_down(run, f"host {lost[0].spec.worker_id}'s raylet is no longer alive in the GCS")
            return
        for node in run.nodes:
            if not node.ready and node.proc is not None and node.node_manager_port in alive:
                node.ready, node.node_id, node.message = True, alive[node.node_manager_port][0], "ready"
        stale = self._drain_previous_hosts(run, alive)
        if not stale and all(n.ready for n in run.nodes):
            if run.status != "ready":
                log.info("slice %s ready", run.name)
            run.status, run.message, run.became_ready, run.failed_starts = "ready", "ready", True, 0
        elif now - min((n.started_mono for n in run.nodes if n.starting), default=now) > START_TIMEOUT_SECONDS:
            self.slice_down(run, f"not all hosts were ready within {START_TIMEOUT_SECONDS:.0f} s")

    def _drain_previous_hosts(self, run: SliceRun, alive: dict[int, tuple[str, str]]) -> list[str]:
        """Hosts of an earlier incarnation of this slice that still look ALIVE: the GCS is told they are gone,
        and the slice is not ready until it drops them."""
        ours = {n.node_manager_port for n in run.nodes}
        stale = [node_id for port, (node_id, slice_) in alive.items() if slice_ == run.name and port not in ours]
        if stale:
            self.gcs.drain(stale)
            run.message = f"waiting for the GCS to drop {len(stale)} dead host(s) of the previous slice"
            for node in run.nodes:
                if node.ready:
                    node.ready, node.message = False, "registered; " + run.message
        return stale

    def keep_serve_config(self) -> None:
        """The cluster of a RayService: while the head runs, have Serve hold the service's config.

        Every :data:`SERVE_CHECK_SECONDS` (and at once when the head is ready again) a thread
        PUTs the config if Serve lacks it, as KubeRay's reconcile does; the loop never waits
        for Serve.
        """
        if self.service_dir is None or not self.head.ready or time.monotonic() < self.next_serve_check:
            return
        if self.serve_check is not None and self.serve_check.is_alive():
            return
        self.next_serve_check = time.monotonic() + SERVE_CHECK_SECONDS
        dashboard = DirectTransport(f"http://127.0.0.1:{self.dashboard_port}")
        self.serve_check = threading.Thread(target=keep_serve_config, args=(self.service_dir, dashboard),
                                            name="serve-config", daemon=True)
        self.serve_check.start()

    # -- main loop ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def run(self) -> int:
        enable_parent_death_signal()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)
        log.info("supervising RayCluster %s/%s (incarnation %s, %d TPU hosts, temp dir %s)",
                 self.plan.namespace, self.plan.name, self.incarnation, self.plan.total_hosts, self.temp_dir)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.publish()
        try:
            while not self.stop_requested:
                if stop := self.stop_reasons.check():
                    if stop.failure:
                        self.fail(*stop.failure)
                    log.warning("stopping: %s", stop.why)
                    break
                self.reconcile()
                self.publish()
                self.keep_serve_config()
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
        module = __spec__.name if __spec__ else "airflow_provider_raytpu.backends.local.supervisor"
        print(f"usage: python -m {module} <state-dir>", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    return Supervisor(Path(args[0]).resolve()).run()


if __name__ == "__main__":
    sys.exit(main())
