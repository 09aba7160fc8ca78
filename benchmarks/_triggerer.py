"""The triggerer side of ``triggerer_capacity.py``: one process, one event loop, N triggers, as Airflow's
triggerer runs them.

Variants: ``watch`` (ours: ``RayClusterReadyTrigger``) and ``poll`` (the baseline: the pattern of
the cncf-kubernetes provider's ``KubernetesJobTrigger``: a cached ``AsyncKubernetesHook`` and, every
``poll_interval`` (its default 10 s), one read through ``hook.get_conn()``, which makes a new
``ApiClient`` per read as ``get_job_status`` does; applied to a RayCluster it GETs the object).

The loop's lag is sampled by a ticker task that sleeps 10 ms and records how late it woke; a
phase's figures are the maximum and the share of the phase's time spent in stalls longer than
100 ms. Each trigger's logger is replaced by a counter, so "watching" means "the trigger has
read its cluster's first status" (it logs it) without writing log lines (a real triggerer writes
them to each task's log: not measured here).
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import cached_property
from typing import Any

import _common

NS = _common.NAMESPACE
CONN = "raytpu_default"
TICK = 0.01
STALL = 0.1


class FirstLine:
    """Stands in for a trigger's logger: notes when the trigger first logs (its first status)."""

    def __init__(self, name: str, seen: dict[str, float]) -> None:
        self.name, self.seen = name, seen

    def info(self, *args: Any, **kwargs: Any) -> None:
        self.seen.setdefault(self.name, time.time())

    warning = error = debug = exception = info


class CncfPollingTrigger:
    """The baseline (see the module docstring) for one RayCluster."""

    def __init__(self, name: str, interval: float, seen: dict[str, float]) -> None:
        self.name, self.interval, self.seen = name, interval, seen

    @cached_property
    def hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        return AsyncKubernetesHook(conn_id="kube_test")

    async def run(self) -> dict[str, Any]:
        from kubernetes_asyncio import client as k8s_async

        from airflow_provider_raytpu.status import read_ray_cluster

        while True:
            async with self.hook.get_conn() as api:
                cluster = await k8s_async.CustomObjectsApi(api).get_namespaced_custom_object(
                    "ray.io", "v1", NS, "rayclusters", self.name)
            status = read_ray_cluster(cluster)
            self.seen.setdefault(self.name, time.time())
            if status.finished:
                return {"status": status.phase.value}
            await asyncio.sleep(self.interval)


def lag_figures(samples: list[tuple[float, float]], start: float, end: float,
                gc_pauses: list[tuple[float, float, int]] = ()) -> dict[str, float]:
    """Lag of the ticks woken in [start, end]: max, p99 and median (ms), the share of the time in stalls
    > 100 ms, and the longest garbage collection and the full ones in that time."""
    lags = [lag for at, lag in samples if start <= at <= end]
    if not lags:
        return {"n": 0}
    stats = _common.describe(lags)
    pauses = [(d, g) for at, d, g in gc_pauses if start <= at <= end]
    return {"n": len(lags), "max_ms": stats["max"] * 1000, "p99_ms": stats["p99"] * 1000,
            "median_ms": stats["median"] * 1000,
            "blocked_over_100ms_share": sum(lag for lag in lags if lag > STALL) / max(1e-9, end - start),
            "gc_max_ms": max((d for d, _ in pauses), default=0.0) * 1000,
            "gc_full_collections": sum(1 for _, g in pauses if g == 2)}


class Triggerer:
    def __init__(self, variant: str, clusters: int, poll_interval: float) -> None:
        import psutil

        self.variant, self.clusters, self.poll_interval = variant, clusters, poll_interval
        self.proc = psutil.Process()
        self.samples: list[tuple[float, float]] = []
        self.seen: dict[str, float] = {}
        self.fired: dict[str, float] = {}
        self.statuses: dict[str, int] = {}
        self.errors: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.gc_pauses: list[tuple[float, float, int]] = []  # (end time, seconds, generation)
        self._watch_gc()

    def _watch_gc(self) -> None:
        """Record the interpreter's garbage collections (they stop the loop like any other callback)."""
        import gc

        started: list[float] = []

        def callback(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                self.gc_pauses.append((time.time(), time.perf_counter() - started[0], info["generation"]))

        gc.callbacks.append(callback)

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    async def ticker(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK)
            self.samples.append((time.time(), time.perf_counter() - t0 - TICK))

    async def one(self, name: str) -> None:
        from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger

        try:
            if self.variant == "watch":
                trigger = RayClusterReadyTrigger(name, NS, CONN, time.time() + 3600, self.poll_interval)
                trigger._log = FirstLine(name, self.seen)
                async for event in trigger.run():
                    payload = event.payload
                    break
            else:
                payload = await CncfPollingTrigger(name, self.poll_interval, self.seen).run()
            self.fired[name] = time.time()
            self.statuses[payload["status"]] = self.statuses.get(payload["status"], 0) + 1
        except Exception as exc:  # reported, not raised: one failure must not hide the figures
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    async def serve(self, conn: Any) -> None:
        ticker = asyncio.create_task(self.ticker())
        await asyncio.sleep(1.0)
        conn.send(("ready", self.proc.memory_info().rss))
        names = [f"rc-{i:04d}" for i in range(self.clusters)]
        while True:
            cmd, *rest = await asyncio.to_thread(conn.recv)
            if cmd == "start":
                started = time.time()
                self.tasks = [asyncio.create_task(self.one(n)) for n in names]
                conn.send(started)
            elif cmd == "status":
                conn.send({"seen": len(self.seen), "fired": len(self.fired), "errors": self.errors[:5]})
            elif cmd == "snapshot":
                conn.send({"rss": self.proc.memory_info().rss, "cpu_seconds": self.cpu(), "time": time.time(),
                           "open_fds": self.proc.num_fds()})
            elif cmd == "lag":
                conn.send(lag_figures(self.samples, rest[0], rest[1], self.gc_pauses))
            elif cmd == "wait_all":
                deadline = time.monotonic() + rest[0]
                while len(self.fired) + len(self.errors) < self.clusters and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                conn.send({"fired": dict(self.fired), "statuses": self.statuses, "errors": self.errors[:20],
                           "error_count": len(self.errors), "seen": dict(self.seen), "time": time.time(),
                           "rss": self.proc.memory_info().rss, "cpu_seconds": self.cpu()})
            elif cmd == "stop":
                for t in self.tasks:
                    t.cancel()
                ticker.cancel()
                await asyncio.gather(*self.tasks, ticker, return_exceptions=True)
                conn.send("bye")
                return


def triggerer_main(conn: Any, kube_connection: str, variant: str, clusters: int, poll_interval: float,
                   collect_after_imports: bool = False) -> None:
    import logging

    _common.raise_fd_limit()
    _common.quiet_logs()
    logging.getLogger("airflow_provider_raytpu").setLevel(logging.ERROR)
    _common.point_connections_at(kube_connection, NS)
    # The fixed floor: what a triggerer has loaded before its first trigger (Airflow's trigger
    # runner, the trigger's module) plus the Kubernetes clients both variants use.
    import airflow.jobs.triggerer_job_runner  # noqa: F401
    import airflow.providers.cncf.kubernetes.hooks.kubernetes  # noqa: F401

    import airflow_provider_raytpu.backends.kuberay  # noqa: F401
    import airflow_provider_raytpu.triggers.raycluster  # noqa: F401

    if collect_after_imports:  # as a triggerer that has run a while: its startup garbage collected once
        import gc

        gc.collect()
    profile = os.environ.get("RAYTPU_BENCH_PROFILE")  # a path prefix: dump a cProfile of the triggerer there
    if not profile:
        asyncio.run(Triggerer(variant, clusters, poll_interval).serve(conn))
        return
    import cProfile

    with cProfile.Profile() as prof:
        asyncio.run(Triggerer(variant, clusters, poll_interval).serve(conn))
    prof.dump_stats(f"{profile}-{variant}-{clusters}.prof")
