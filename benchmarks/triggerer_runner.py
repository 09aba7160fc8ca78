"""1000 RayCluster sensors in Airflow's own trigger runner (the process a triggerer forks), not a harness loop.

``triggerer_capacity.py`` runs the triggers on a loop of its own; this runs them the way
``airflow triggerer`` does: a ``TriggerRunnerSupervisor`` (here subclassed only where it would
read and write the metadata database: which triggers to run, where their events go) forks
Airflow's ``TriggerRunner``, sends it the ``RunTrigger`` workloads (encrypted kwargs, a task
instance each, so every trigger writes its own task log file through the supervisor, as in a
deployment) and collects the events. A probe trigger (``_runner_probe.LoopLagProbe``) in the
same runner samples the runner's loop. The fake Kubernetes API server runs in its own process
(HTTPS, a cluster CA), as in ``triggerer_capacity.py``.

Phases: the runner with only the probe (its floor, of memory and of loop stalls: Airflow's own
runner stalls its loop now and then, with no trigger of ours in it), every sensor handed over at once (a
triggerer restart), a steady window, a re-watch (the server ends the watch streams), every
cluster ready at once.

Run: ``.venv/bin/python benchmarks/triggerer_runner.py [--sensors 1000] [--steady 20]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common

_common.setup_airflow_env()
os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "INFO"  # the triggers' lines go to their task logs, as deployed

from _kube_server import server_main  # noqa: E402
from _triggerer import lag_figures  # noqa: E402

NS = _common.NAMESPACE
PROBE = 0


class Run:
    """What the benchmark's supervisor runs, and what came back."""

    def __init__(self) -> None:
        self.wanted: set[int] = set()
        self.workloads: dict[int, Any] = {}
        self.fired: dict[int, float] = {}
        self.payloads: dict[int, Any] = {}
        self.failures: dict[int, Any] = {}


RUN = Run()


def supervisor_class() -> type:
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor

    class BenchSupervisor(TriggerRunnerSupervisor):  # type: ignore[misc]
        """The real supervisor, with the metadata database replaced by :data:`RUN`."""

        def load_triggers(self) -> None:
            self.update_triggers(set(RUN.wanted))

        def build_trigger_workloads(self, new_trigger_ids: set[int]) -> list[Any]:
            return [RUN.workloads[i] for i in new_trigger_ids]

        def heartbeat(self) -> None:
            pass

        def metric_tags(self) -> dict[str, str]:
            return {"hostname": "bench"}

        def on_trigger_event(self, trigger_id: int, event: Any) -> None:
            RUN.fired[trigger_id] = time.time()
            RUN.payloads[trigger_id] = event.payload
            RUN.wanted.discard(trigger_id)

        def on_trigger_failure(self, trigger_id: int, exc: Any) -> None:
            RUN.failures[trigger_id] = exc
            RUN.wanted.discard(trigger_id)

        def clean_unused(self) -> None:
            pass

    return BenchSupervisor


def workload(supervisor: Any, trigger_id: int, classpath: str, kwargs: dict[str, Any], logs: Path) -> Any:
    from airflow.executors.workloads import RunTrigger
    from airflow.executors.workloads.task import TaskInstanceDTO
    from airflow.jobs.triggerer_job_runner import TriggerLoggingFactory
    from airflow.models.trigger import Trigger

    ti = TaskInstanceDTO(id=uuid.uuid4(), task_id=f"wait_{trigger_id:04d}", dag_id="bench_runner",
                         run_id="manual__bench", try_number=1, map_index=-1, dag_version_id=uuid.uuid4(),
                         pool_slots=1, priority_weight=1)
    supervisor.logger_cache[trigger_id] = TriggerLoggingFactory(log_path=str(logs / f"{trigger_id:04d}.log"), ti=ti)
    return RunTrigger(id=trigger_id, classpath=classpath, encrypted_kwargs=Trigger.encrypt_kwargs(kwargs), ti=ti)


def serve_until(supervisor: Any, done: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.run_once()
        if done():
            return True
    return False


def first_status_times(logs: Path) -> list[float]:
    """When each sensor's task log got its first status line (the trigger logs it on its first read)."""
    from datetime import datetime

    found = []
    for path in logs.glob("[0-9]*.log"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if str(record.get("event", "")).startswith("RayCluster "):
                found.append(datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp())
                break
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sensors", type=int, default=1000)
    parser.add_argument("--steady", type=float, default=20.0)
    parser.add_argument("--alone", type=float, default=30.0, help="seconds of the runner with only the probe")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--freeze-before-fork", action="store_true",
                        help="gc.freeze() in the supervisor before it forks the runner (not what the triggerer does)")
    args = parser.parse_args()
    _common.quiet_logs()
    _common.raise_fd_limit()
    import psutil

    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(s_child, args.sensors, 0.05, True), daemon=True)
    server.start()
    _, kube_connection = s_parent.recv()
    _common.point_connections_at(kube_connection, NS)
    import airflow.jobs.triggerer_job_runner  # noqa: F401

    import airflow_provider_raytpu.backends.kuberay  # noqa: F401
    import airflow_provider_raytpu.triggers.raycluster  # noqa: F401

    def ask(*msg: Any) -> Any:
        s_parent.send(msg)
        return s_parent.recv()

    result = _common.Result("triggerer_runner_frozen" if args.freeze_before_fork else "triggerer_runner",
                            {**vars(args), "transport": "tls", "runner": "Airflow's "
                             "TriggerRunnerSupervisor (database calls replaced) forking its TriggerRunner"})
    work = Path(tempfile.mkdtemp(prefix="raytpu-bench-runner-"))
    logs, stop_file = work / "logs", work / "stop"
    logs.mkdir()
    if args.freeze_before_fork:  # what Airflow's LocalExecutor and DAG processor do before they fork
        import gc

        gc.freeze()
    supervisor = supervisor_class().start(job=None, capacity=args.sensors + 10)
    try:
        runner = psutil.Process(supervisor.pid)
        RUN.workloads[PROBE] = workload(supervisor, PROBE, "_runner_probe.LoopLagProbe",
                                        {"stop_file": str(stop_file)}, logs)
        RUN.wanted.add(PROBE)
        serve_until(supervisor, lambda: False, 3.0)
        t_alone = time.time()
        serve_until(supervisor, lambda: False, args.alone)
        floor = runner.memory_info().rss
        ids = list(range(1, args.sensors + 1))
        for i in ids:
            RUN.workloads[i] = workload(
                supervisor, i, "airflow_provider_raytpu.triggers.raycluster.RayClusterReadyTrigger",
                {"cluster_name": f"rc-{i - 1:04d}", "namespace": NS,
                 "raytpu_conn_id": "raytpu_default", "deadline": time.time() + 3600,
                 "poll_interval": 10.0}, logs)
        t_start = time.time()
        RUN.wanted.update(ids)
        watching = serve_until(supervisor, lambda: ask("open_watches") >= 1 and
                               sum(1 for p in logs.glob("[0-9]*.log") if p.stat().st_size) >= len(ids),
                               args.timeout)
        serve_until(supervisor, lambda: False, 2.0)
        firsts = first_status_times(logs)
        t_steady, r0 = time.time(), ask("requests")
        serve_until(supervisor, lambda: False, args.steady)
        rss, r1 = runner.memory_info().rss, ask("requests")
        t_end = ask("end_watches")
        serve_until(supervisor, lambda: False, 3.0)
        flip = ask("flip")
        fired = serve_until(supervisor, lambda: all(i in RUN.fired or i in RUN.failures for i in ids), args.timeout)
        t_fired = time.time()
        ready_times = ask("ready_times")
        stop_file.touch()
        serve_until(supervisor, lambda: PROBE in RUN.fired, 30.0)
    finally:
        supervisor.kill(escalation_delay=5.0) if hasattr(supervisor, "kill") else None
        s_parent.send(("stop",))
        server.join(30)
    probe = RUN.payloads.get(PROBE, {})
    samples = [tuple(s) for s in probe.get("samples", [])]
    pauses = [tuple(p) for p in probe.get("gc", [])]
    reactions = [RUN.fired[i] - ready_times[f"rc-{i - 1:04d}"] for i in ids
                 if i in RUN.fired and f"rc-{i - 1:04d}" in ready_times]
    run = {"floor_rss_mib": floor / 2**20, "rss_mib": rss / 2**20,
           "rss_per_sensor_kib": (rss - floor) / len(ids) / 1024, "all_watching": watching,
           "all_watching_s": (max(firsts) - t_start) if len(firsts) == len(ids) else None,
           "alone_lag": lag_figures(samples, t_alone, t_start, pauses),
           "restart_lag": lag_figures(samples, t_start, t_steady, pauses),
           "period_lag": lag_figures(samples, t_steady, flip, pauses),
           "steady_requests": {k: r1.get(k, 0) - r0.get(k, 0) for k in r1 if r1.get(k, 0) != r0.get(k, 0)},
           "firing_lag": lag_figures(samples, flip, t_fired, pauses), "fired": len([i for i in ids if i in RUN.fired]),
           "failures": {str(k): str(v)[:300] for k, v in list(RUN.failures.items())[:5]},
           "all_fired": fired, "fire_all_after_switch_s": (max(RUN.fired[i] for i in ids if i in RUN.fired) - flip)
           if RUN.fired else None, "reaction_s": _common.describe(reactions), "rewatch_at": t_end}
    run["longest_stalls"] = [(round(at - t_start, 3), round(lag * 1000, 1))
                             for at, lag in sorted(samples, key=lambda x: -x[1])[:10]]
    run["longest_collections"] = [(round(at - t_start, 3), round(d * 1000, 1), g)
                                  for at, d, g in sorted(pauses, key=lambda x: -x[1])[:5]]
    run["phase_starts"] = {"handover": 0.0, "steady": t_steady - t_start, "rewatch": t_end - t_start,
                           "flip": flip - t_start, "fired": t_fired - t_start}
    result["run"] = run
    tag = f"{args.sensors} sensors in Airflow's trigger runner, TLS" + (
        ", gc.freeze() before the fork" if args.freeze_before_fork else "")
    result.add(f"{tag}: runner process RSS", run["rss_mib"], None, "MiB", baseline_name="")
    result.add(f"{tag}: runner floor (only the probe trigger)", run["floor_rss_mib"], None, "MiB", baseline_name="")
    result.add(f"{tag}: RSS per sensor above the floor", run["rss_per_sensor_kib"], None, "KiB", baseline_name="")
    result.add(f"{tag}: time until all logged their first status", run["all_watching_s"], None, "s", baseline_name="")
    result.add(f"{tag}: loop lag max, the runner alone (only the probe), {args.alone:g} s",
               run["alone_lag"].get("max_ms"), None, "ms", baseline_name="")
    result.add(f"{tag}: loop lag max, all handed over at once", run["restart_lag"].get("max_ms"), None, "ms",
               baseline_name="")
    result.add(f"{tag}: its longest garbage collection", run["restart_lag"].get("gc_max_ms"), None, "ms",
               baseline_name="")
    result.add(f"{tag}: loop lag max, steady + re-watch", run["period_lag"].get("max_ms"), None, "ms", baseline_name="")
    result.add(f"{tag}: loop lag max, all ready at once", run["firing_lag"].get("max_ms"), None, "ms", baseline_name="")
    result.add(f"{tag}: reaction to its cluster's ready commit, p95", run["reaction_s"].get("p95"), None, "s",
               baseline_name="")
    result.add(f"{tag}: sensors fired", run["fired"], None, "", baseline_name="", lower_is_better=False)
    result["notes"] = [
        "the supervisor's database work (assigning triggers, writing events and failures) is replaced by memory; "
        "everything else is Airflow's: the forked runner, its comms, kwargs decryption, per-trigger task log files",
        "loop lag = a probe trigger in the same runner sleeping 10 ms and recording how late it woke",
        f"task log files: {logs}",
    ]
    result.finish()


if __name__ == "__main__":
    main()
