"""Triggerer capacity: one asyncio process holding many concurrent RayClusterReadyTriggers.

As Airflow's triggerer does, one process runs every trigger as a task on one event loop. For each
size (200 and 1000 by default) and each variant, in fresh processes:

- ``watch`` (ours): ``RayClusterReadyTrigger`` per RayCluster (list once, then watch);
- ``poll`` (baseline): a polling trigger per RayCluster, every ``--poll-interval`` s (10 s, the
  provider's own fallback interval) it reads what a poke reads (GET the RayCluster + list its pods,
  ``status.read_ray_cluster``) through a fresh client per read, as the cncf-kubernetes async hook
  does per call. Poll phases are spread at random over the interval (triggers start at different
  times in a real triggerer).

The fake API server (tests/fakekube, real HTTP) runs in a SEPARATE process, so its work does not land
on the measured event loop (they still share the machine's cores). Each RayCluster (v6e 2x2: head +
1 host) is stamped from a template the KubeRay reactor made pending, and stays so until the switch,
when the server writes every cluster's ready state as the reactor produced it for the template (pods
Running+Ready, then the RayCluster status).

Measured in the triggerer process, after every watch is established (every trigger's first read
done), over a steady window: RSS (psutil) and its growth per trigger over an idle baseline process
state, event-loop lag (a ticker task sleeping 10 ms and recording the overshoot: median / p99 / max),
CPU use, and API requests per second. Then every cluster is made ready at once: time from that switch
until every trigger has fired, and per-trigger reaction (event - the commit that made its cluster
ready, median / p99 / max). Lag during establishment and firing is in the JSON.

Run: ``.venv/bin/python benchmarks/triggerer_capacity.py [--sizes 200,1000] [--variants watch,poll]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import time
from typing import Any

import _common

_common.setup_airflow_env()

NS = _common.NAMESPACE
CONN = "raytpu_default"
TICK = 0.01


# ================================================================================================
# The API server process
# ================================================================================================

def _stamp_pod(template: dict, cluster: str, uid: str, template_cluster: str) -> dict:
    """A copy of one of the template cluster's pods, for ``cluster`` (name, labels, owner)."""
    import copy

    pod = copy.deepcopy(template)
    meta = pod["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generateName"):
        meta.pop(key, None)
    meta["name"] = meta["name"].replace(template_cluster, cluster, 1)
    meta["labels"] = {k: (v.replace(template_cluster, cluster, 1) if isinstance(v, str) else v)
                      for k, v in (meta.get("labels") or {}).items()}
    for ref in meta.get("ownerReferences") or []:
        ref["name"], ref["uid"] = cluster, uid
    return pod


def server_main(conn: Any, clusters: int, delay: float) -> None:
    """The fake API server's process. The KubeRay reactor makes ONE template RayCluster pending, then
    ready; the ``clusters`` RayClusters are stamped from its pending state (pods Pending, status as
    the reactor wrote it), and at the switch each gets the reactor's ready state written: its pods
    Running+Ready, then its RayCluster status (the order the reactor writes them). Reconciling 1000
    clusters through the reactor itself is O(clusters^2) in the fake and would dominate the run."""
    _common.raise_fd_limit()
    _common.quiet_logs()
    from tests.fakekube.kuberay import KubeRayReactor
    from tests.fakekube.server import FakeKubeApiServer

    ready_at: dict[str, float] = {}
    tmpl = "tmpl"

    def on_change(ev: Any) -> None:
        if _common.is_ready_commit(ev):
            ready_at.setdefault(ev.name, time.time())

    def pods_of(name: str) -> list[dict]:
        return server.list_objects("pods", NS, label_selector={"ray.io/cluster": name})

    with FakeKubeApiServer(history_limit=100_000) as server:
        with KubeRayReactor(server, delay=delay, stagger=0.0, mode="hold") as reactor:
            server.create_object(_common.cluster_manifest(tmpl, topology="2x2"))
            server.wait_for(lambda: len(pods_of(tmpl)) == 2 and (
                (server.get_object("rayclusters", NS, tmpl) or {}).get("status") or {}).get("conditions"), timeout=60)
            time.sleep(0.2)
            pending_status = server.get_object("rayclusters", NS, tmpl)["status"]
            pending_pods = {p["metadata"]["labels"]["ray.io/node-type"]: p for p in pods_of(tmpl)}
            reactor.set_mode("auto", cluster=tmpl, namespace=NS)
            reactor.wait_ready(tmpl, NS, timeout=60)
            time.sleep(0.2)
            ready_status = server.get_object("rayclusters", NS, tmpl)["status"]
            ready_pods = {p["metadata"]["labels"]["ray.io/node-type"]: p["status"] for p in pods_of(tmpl)}
        # the reactor is stopped: nothing but this process writes from here on
        server.delete_object("rayclusters", NS, tmpl, force=True)
        for pod in pods_of(tmpl):
            server.delete_object("pods", NS, pod["metadata"]["name"], force=True)
        server.on_change(on_change)
        stamped: dict[str, list[tuple[str, str]]] = {}
        for i in range(clusters):
            name = f"rc-{i:04d}"
            rc = server.create_object(_common.cluster_manifest(name, topology="2x2"))
            server.set_status("rayclusters", NS, name, pending_status)
            stamped[name] = []
            for node_type, template in pending_pods.items():
                pod = server.put_object(_stamp_pod(template, name, rc["metadata"]["uid"], tmpl))
                stamped[name].append((pod["metadata"]["name"], node_type))
        conn.send(("ready", server.airflow_connection(NS)))
        while True:
            cmd, *rest = conn.recv()
            if cmd == "open_watches":
                conn.send(server.open_watches)
            elif cmd == "cut":
                conn.send(server.cut_watches())
            elif cmd == "requests":
                conn.send(dict(server.counters))
            elif cmd == "flip":
                conn.send(time.time())
                for name, pods in stamped.items():
                    for pod_name, node_type in pods:
                        server.set_status("pods", NS, pod_name, ready_pods[node_type])
                    server.set_status("rayclusters", NS, name, ready_status)
            elif cmd == "ready_times":
                conn.send(dict(ready_at))
            elif cmd == "stop":
                conn.send("bye")
                break


# ================================================================================================
# The triggerer process
# ================================================================================================

class PollingRayClusterTrigger:
    """The baseline: a deferrable sensor's trigger that polls (what most existing triggers do)."""

    def __init__(self, backend: Any, name: str, interval: float, first_reads: list, shared_client: bool) -> None:
        self.backend, self.name, self.interval, self.first_reads = backend, name, interval, first_reads
        self.shared_client = shared_client

    async def read(self, api: Any) -> Any:
        from airflow_provider_raytpu.backends.kuberay.diagnosis import acluster_status

        cluster = await self.backend.objects.aget(api, self.name, NS)
        return await acluster_status(api, cluster)

    async def read_fresh(self) -> Any:
        async with self.backend.clients.async_api_client() as api:
            return await self.read(api)

    async def run(self) -> Any:
        if self.shared_client:
            async with self.backend.clients.async_api_client() as api:
                return await self._run(lambda: self.read(api))
        return await self._run(self.read_fresh)

    async def _run(self, read: Any) -> Any:
        status = await read()
        self.first_reads.append(self.name)
        await asyncio.sleep(random.uniform(0, self.interval))  # spread the phases
        while not status.finished:
            status = await read()
            if not status.finished:
                await asyncio.sleep(self.interval)
        return {"status": status.phase.value}


class Triggerer:
    def __init__(self, variant: str, clusters: int, poll_interval: float) -> None:
        import psutil

        self.variant, self.clusters, self.poll_interval = variant, clusters, poll_interval
        self.proc = psutil.Process()
        self.phase = "idle"
        self.lags: dict[str, list[float]] = {}
        self.cpu_marks: dict[str, tuple[float, float]] = {}
        self.phase_cpu: dict[str, float] = {}  # CPU seconds of each finished phase
        self.fired: dict[str, float] = {}
        self.statuses: dict[str, int] = {}
        self.errors: list[str] = []
        self.first_reads: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.ssl_contexts: dict[str, dict[str, float]] = {}
        self._count_ssl_contexts()

    def _count_ssl_contexts(self) -> None:
        """Count (not change) ssl.create_default_context calls per phase: each loads the CA store, on the loop."""
        import ssl

        original = ssl.create_default_context

        def counted(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                entry = self.ssl_contexts.setdefault(self.phase, {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - t0

        ssl.create_default_context = counted

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def set_phase(self, phase: str) -> None:
        now = (time.monotonic(), self.cpu())
        if self.phase in self.cpu_marks:
            self.phase_cpu[self.phase] = now[1] - self.cpu_marks[self.phase][1]
        self.phase = phase
        self.cpu_marks[phase] = now

    def cpu_share(self, phase: str, until: tuple[float, float] | None = None) -> float:
        start = self.cpu_marks[phase]
        end = until or (time.monotonic(), self.cpu())
        return (end[1] - start[1]) / max(1e-9, end[0] - start[0])

    async def ticker(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK)
            self.lags.setdefault(self.phase, []).append(time.perf_counter() - t0 - TICK)

    async def one(self, name: str, backend: Any) -> None:
        from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger

        try:
            if self.variant.startswith("watch"):
                async for event in RayClusterReadyTrigger(name, NS, CONN, time.time() + 3600).run():
                    payload = event.payload
                    break
            else:
                payload = await PollingRayClusterTrigger(backend, name, self.poll_interval, self.first_reads,
                                                         self.variant == "poll-shared").run()
            self.fired[name] = time.time()
            self.statuses[payload["status"]] = self.statuses.get(payload["status"], 0) + 1
        except Exception as exc:  # reported, not raised: one failure must not hide the figures
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    def lag_stats(self) -> dict[str, Any]:
        return {phase: {k: v * 1000 for k, v in _common.describe(values).items() if k != "n"} | {"n": len(values)}
                for phase, values in self.lags.items()}

    async def serve(self, conn: Any) -> None:
        from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

        backend = await RayTpuHook(CONN).abackend()
        ticker = asyncio.create_task(self.ticker())
        await asyncio.sleep(1.0)
        baseline_rss = self.proc.memory_info().rss
        conn.send(("ready", baseline_rss))
        names = [f"rc-{i:04d}" for i in range(self.clusters)]
        while True:
            cmd, *rest = await asyncio.to_thread(conn.recv)
            if cmd == "start":
                self.set_phase("establish")
                self.tasks = [asyncio.create_task(self.one(n, backend)) for n in names]
                conn.send(time.time())
            elif cmd == "status":
                conn.send({"first_reads": len(self.first_reads), "fired": len(self.fired), "errors": self.errors[:5],
                           "tasks_done": sum(t.done() for t in self.tasks)})
            elif cmd == "phase":
                self.set_phase(rest[0])
                conn.send(time.time())
            elif cmd == "snapshot":
                mem = self.proc.memory_info()
                conn.send({"rss": mem.rss, "cpu_share_of_a_core": self.cpu_share(self.phase),
                           "cpu_seconds": self.cpu() - self.cpu_marks[self.phase][1],
                           "open_fds": self.proc.num_fds(), "lag_ms": self.lag_stats(),
                           "ssl_contexts": self.ssl_contexts, "phase_cpu_s": self.phase_cpu})
            elif cmd == "wait_all":
                deadline = time.monotonic() + rest[0]
                while len(self.fired) + len(self.errors) < self.clusters and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                conn.send({"fired": dict(self.fired), "statuses": self.statuses, "errors": self.errors[:20],
                           "error_count": len(self.errors), "cpu_share_of_a_core": self.cpu_share(self.phase),
                           "lag_ms": self.lag_stats(), "rss": self.proc.memory_info().rss,
                           "ssl_contexts": self.ssl_contexts})
            elif cmd == "stop":
                for t in self.tasks:
                    t.cancel()
                ticker.cancel()
                await asyncio.gather(*self.tasks, ticker, return_exceptions=True)
                conn.send("bye")
                return


def triggerer_main(conn: Any, kube_connection: str, variant: str, clusters: int, poll_interval: float) -> None:
    import logging

    _common.raise_fd_limit()
    _common.quiet_logs()
    logging.getLogger("airflow_provider_raytpu").setLevel(logging.ERROR)  # the re-watch phase's "dropped" warnings
    _common.point_connections_at(kube_connection, NS)
    # What a triggerer has loaded before its first trigger: Airflow, the provider's triggers and clients.
    import airflow.triggers.base  # noqa: F401
    import airflow_provider_raytpu.backends.kuberay  # noqa: F401
    import airflow_provider_raytpu.triggers.raycluster  # noqa: F401

    profile = os.environ.get("RAYTPU_BENCH_PROFILE")  # a path prefix: dump a cProfile of the triggerer there
    if not profile:
        asyncio.run(Triggerer(variant, clusters, poll_interval).serve(conn))
        return
    import cProfile

    with cProfile.Profile() as prof:
        asyncio.run(Triggerer(variant, clusters, poll_interval).serve(conn))
    prof.dump_stats(f"{profile}-{variant}-{clusters}.prof")


# ================================================================================================
# The orchestrator
# ================================================================================================

def ask(conn: Any, *msg: Any, timeout: float = 600.0) -> Any:
    conn.send(msg)
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {msg[0]!r} within {timeout} s")
    return conn.recv()


def cut_every_watch(clusters: int, args: argparse.Namespace, s_parent: Any, t_parent: Any, establish_s: float,
                    baseline_rss: int) -> dict[str, Any]:
    """Every WATCH_SECONDS each trigger re-opens its watch (a new client), and all at once when the API
    server restarts or a proxy drops its streams. Cut every stream and measure what re-opening costs."""
    req0 = ask(s_parent, "requests")
    ask(t_parent, "phase", "rewatch")
    t_cut = time.time()
    cut = ask(s_parent, "cut")
    time.sleep(0.2)
    back = False
    while time.time() - t_cut < args.establish_timeout:
        if ask(s_parent, "open_watches") >= clusters:
            back = True
            break
        time.sleep(0.1)
    all_back_s = time.time() - t_cut
    open_at_end = ask(s_parent, "open_watches")
    time.sleep(1.0)
    snap = ask(t_parent, "snapshot")
    req1 = ask(s_parent, "requests")
    ask(t_parent, "stop", timeout=120)
    ask(s_parent, "stop", timeout=60)
    ssl_cut = snap["ssl_contexts"].get("rewatch", {"calls": 0, "seconds": 0.0})
    return {
        "variant": "watch-cut",
        "triggers": clusters,
        "establish_s": establish_s,
        "baseline_rss_mib": baseline_rss / 2**20,
        "rss_mib": snap["rss"] / 2**20,
        "cut": cut,
        "all_back": back,
        "open_watches_at_end": open_at_end,
        "all_back_s": all_back_s if back else None,
        "cpu_seconds": snap["cpu_seconds"],
        "cpu_ms_per_rewatch": snap["cpu_seconds"] / max(1, cut) * 1000,
        "ssl_contexts_per_cut_watch": ssl_cut["calls"] / max(1, cut),
        "api_requests_by_verb": {k: req1.get(k, 0) - req0.get(k, 0) for k in req1},
        "lag_ms": snap["lag_ms"].get("rewatch", {}),
        "ssl_contexts_created": snap["ssl_contexts"],
    }


def run_one(variant: str, clusters: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(s_child, clusters, args.delay), daemon=True)
    server.start()
    trig = None
    try:
        if not s_parent.poll(600):
            raise TimeoutError("the API server process did not start")
        _, kube_connection = s_parent.recv()
        t_parent, t_child = ctx.Pipe()
        trig = ctx.Process(target=triggerer_main, args=(t_child, kube_connection, variant, clusters,
                                                        args.poll_interval), daemon=True)
        trig.start()
        if not t_parent.poll(300):
            raise TimeoutError("the triggerer process did not start")
        _, baseline_rss = t_parent.recv()
        t_start = ask(t_parent, "start")
        established = None
        deadline = time.time() + args.establish_timeout
        while time.time() < deadline:
            status = ask(t_parent, "status")
            done = ask(s_parent, "open_watches") if variant.startswith("watch") else status["first_reads"]
            if done >= clusters:
                established = time.time()
                break
            if status["errors"]:
                raise RuntimeError(f"triggers failed: {status['errors']}")
            time.sleep(0.1)
        if established is None:
            raise TimeoutError(f"{variant}: only {done} of {clusters} established in {args.establish_timeout} s")
        time.sleep(1.0)  # let the last reads finish
        if variant == "watch-cut":
            return cut_every_watch(clusters, args, s_parent, t_parent, established - t_start, baseline_rss)
        req0 = ask(s_parent, "requests")
        ask(t_parent, "phase", "steady")
        t0 = time.time()
        time.sleep(args.steady)
        steady = ask(t_parent, "snapshot")
        req1 = ask(s_parent, "requests")
        steady_s = time.time() - t0
        ask(t_parent, "phase", "firing")
        flip = ask(s_parent, "flip")
        done = ask(t_parent, "wait_all", args.fire_timeout, timeout=args.fire_timeout + 60)
        ready_times = ask(s_parent, "ready_times")
        ask(t_parent, "stop", timeout=60)
        ask(s_parent, "stop", timeout=60)
    finally:
        for p in (trig, server):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join(5)

    fired = done["fired"]
    reactions = [fired[n] - ready_times[n] for n in fired if n in ready_times]
    requests = sum(req1.values()) - sum(req0.values())
    out = {
        "variant": variant,
        "triggers": clusters,
        "establish_s": established - t_start,
        "establish_cpu_ms_per_trigger": steady["phase_cpu_s"].get("establish", 0.0) / clusters * 1000,
        "baseline_rss_mib": baseline_rss / 2**20,
        "steady_rss_mib": steady["rss"] / 2**20,
        "rss_per_trigger_kib": (steady["rss"] - baseline_rss) / clusters / 1024,
        "open_fds": steady["open_fds"],
        "steady_window_s": steady_s,
        "steady_cpu_share_of_a_core": steady["cpu_share_of_a_core"],
        "steady_api_requests_per_s": requests / steady_s,
        "steady_api_requests_by_verb": {k: req1.get(k, 0) - req0.get(k, 0) for k in req1},
        "lag_ms": done["lag_ms"],
        "ssl_contexts_created": done["ssl_contexts"],
        "steady_lag_ms": steady["lag_ms"].get("steady", {}),
        "fired": len(fired),
        "statuses": done["statuses"],
        "errors": done["errors"],
        "error_count": done["error_count"],
        "fire_all_s": (max(fired.values()) - flip) if fired else None,
        "fire_all_after_last_ready_commit_s": (max(fired.values()) - max(ready_times.values()))
        if fired and ready_times else None,
        "last_ready_commit_after_switch_s": (max(ready_times.values()) - flip) if ready_times else None,
        "reaction_s": _common.describe(reactions),
        "firing_cpu_share_of_a_core": done["cpu_share_of_a_core"],
        "final_rss_mib": done["rss"] / 2**20,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="200,1000", help="concurrent triggers, comma-separated")
    parser.add_argument("--variants", default="watch,watch-cut,poll,poll-shared",
                        help="watch (ours), watch-cut (ours: every watch cut at once, in its own run), "
                             "poll (a fresh client per read), poll-shared (one client per trigger)")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    parser.add_argument("--poll-interval", type=float, default=10.0, help="the polling trigger's interval")
    parser.add_argument("--delay", type=float, default=0.05, help="reactor: seconds until the template's pods are ready")
    parser.add_argument("--watch-seconds", type=float, default=240.0,
                        help="the re-watch period used to derive steady CPU with re-watches (kuberay.watch.WATCH_SECONDS)")
    parser.add_argument("--establish-timeout", type=float, default=300.0)
    parser.add_argument("--fire-timeout", type=float, default=300.0)
    args = parser.parse_args()
    _common.quiet_logs()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    result = _common.Result("triggerer_capacity", {
        "sizes": sizes, "variants": variants, "steady_window_s": args.steady, "poll_interval_s": args.poll_interval,
        "establish_timeout_s": args.establish_timeout,
        "variants_meaning": {"watch": "RayClusterReadyTrigger (ours)",
                             "watch-cut": "ours, own run: every watch stream cut at once after establishment",
                             "poll": "polling trigger, a fresh client per read (as the cncf-kubernetes async hook)",
                             "poll-shared": "polling trigger keeping one client"},
        "lag_ticker_s": TICK, "cluster": "v6e 2x2 (head + 1 host)",
        "clusters": "stamped from a template the KubeRay reactor made pending and ready; the switch writes each "
                    "cluster's pods ready then its status (the reactor's ready state), in one pass",
        "processes": "fake API server + reactor in one process, triggerer in another (both spawned fresh per run)",
        "fd_soft_limit": _common.raise_fd_limit(),
    })
    runs: list[dict[str, Any]] = []
    for n in sizes:
        for variant in variants:
            print(f"  running {variant} x {n} ...", flush=True)
            try:
                runs.append(run_one(variant, n, args))
            except Exception as exc:
                runs.append({"variant": variant, "triggers": n, "error": f"{type(exc).__name__}: {exc}"})
                print(f"    failed: {exc}", flush=True)
    result["runs"] = runs
    by = {(r["variant"], r["triggers"]): r for r in runs if "error" not in r}

    rows = []
    for n in sizes:
        for variant in variants:
            r = by.get((variant, n))
            if r and variant != "watch-cut":
                lag = r["steady_lag_ms"]
                rows.append([f"{variant} x {n}", _common.fmt(r["steady_rss_mib"]), _common.fmt(r["rss_per_trigger_kib"]),
                             _common.fmt(lag.get("median")), _common.fmt(lag.get("p99")), _common.fmt(lag.get("max")),
                             _common.fmt(r["steady_cpu_share_of_a_core"] * 100),
                             _common.fmt(r["steady_api_requests_per_s"]), _common.fmt(r["establish_s"]),
                             _common.fmt(r["fire_all_s"]), _common.fmt(r["reaction_s"].get("median")),
                             f"{r['fired']}/{n}"])
        w = by.get(("watch", n))
        if not w:
            continue
        # A periodic re-watch builds the same clients as establishing a watch (minus the first list and
        # pods list): the establish CPU per trigger is its measured upper bound.
        w["steady_cpu_with_rewatches_derived"] = (w["steady_cpu_share_of_a_core"]
                                                  + n / args.watch_seconds * w["establish_cpu_ms_per_trigger"] / 1000)
        for variant, full in (("poll", True), ("poll-shared", False)):
            base = by.get((variant, n))
            if base is None:
                continue
            pl = f"{variant} {args.poll_interval:g} s"
            blag, wlag = base["steady_lag_ms"], w["steady_lag_ms"]
            result.add(f"{n} triggers: RSS per trigger", w["rss_per_trigger_kib"], base["rss_per_trigger_kib"], "KiB",
                       baseline_name=pl)
            if full:
                result.add(f"{n} triggers: process RSS", w["steady_rss_mib"], base["steady_rss_mib"], "MiB",
                           baseline_name=pl)
            result.add(f"{n} triggers: loop lag p99, steady", wlag.get("p99"), blag.get("p99"), "ms", baseline_name=pl)
            if full:
                result.add(f"{n} triggers: loop lag max, steady", wlag.get("max"), blag.get("max"), "ms",
                           baseline_name=pl)
                result.add(f"{n} triggers: triggerer CPU, steady between re-watches", w["steady_cpu_share_of_a_core"] * 100,
                           base["steady_cpu_share_of_a_core"] * 100, "% of a core", baseline_name=pl)
            result.add(f"{n} triggers: triggerer CPU incl. a re-watch every {args.watch_seconds:g} s",
                       w["steady_cpu_with_rewatches_derived"] * 100, base["steady_cpu_share_of_a_core"] * 100,
                       "% of a core", baseline_name=pl,
                       how="ours derived (steady + triggers/240 s x establish CPU per trigger), poll measured")
            if full:
                result.add(f"{n} triggers: API requests/s, steady", w["steady_api_requests_per_s"],
                           base["steady_api_requests_per_s"], "req/s", baseline_name=pl)
            result.add(f"{n} triggers: time to fire all after the switch", w["fire_all_s"], base["fire_all_s"], "s",
                       baseline_name=pl)
            if full:
                result.add(f"{n} triggers: reaction per trigger, median", w["reaction_s"].get("median"),
                           base["reaction_s"].get("median"), "s", baseline_name=pl)
        cut = by.get(("watch-cut", n))
        if cut:
            back = f"measured; all open again after {cut['all_back_s']:.0f} s" if cut["all_back"] else \
                f"measured; NOT all open again within {args.establish_timeout:g} s"
            result.add(f"{n} triggers: every watch cut at once, CPU per re-open", cut["cpu_ms_per_rewatch"],
                       w["establish_cpu_ms_per_trigger"], "ms", baseline_name="ours, establishing one watch", how=back)
            result.add(f"{n} triggers: every watch cut at once, loop lag max", cut["lag_ms"].get("max"), None, "ms",
                       baseline_name="", how=back)
    result["notes"] = [
        "rss_per_trigger = (steady RSS - RSS of the same process before any trigger) / triggers",
        "loop lag = overshoot of asyncio.sleep(0.01) in a ticker task on the triggers' loop",
        "time to fire all = last trigger event - the switch (the server then writes every cluster's ready state in "
        "one pass: last_ready_commit_after_switch_s); reaction = event - the commit that made that cluster ready",
        "steady figures of the watch variant fall between watch re-opens (every WATCH_SECONDS); the derived CPU adds "
        "triggers / WATCH_SECONDS re-opens per second at the measured establish CPU per trigger (an upper bound)",
        "watch-cut: its own run; after establishment every stream is cut at once (an API server restart) and the "
        "run waits until every watch is open again (or the establish timeout): cpu_ms_per_rewatch, loop lag, SSL "
        "contexts built",
        "ssl_contexts_created: ssl.create_default_context calls per phase and the time spent in them (counted by "
        "wrapping the function, behaviour unchanged)",
    ]
    path = result.write()
    print()
    _common.print_table(["run", "RSS MiB", "KiB/trigger", "lag med ms", "lag p99 ms", "lag max ms", "CPU %",
                         "req/s", "establish s", "fire all s", "reaction med s", "fired"], rows)
    result.print_table()
    print(f"  -> {path.relative_to(_common.REPO)}")


if __name__ == "__main__":
    main()
