"""API load: requests to the Kubernetes API server per waiting sensor-hour, watch trigger vs polling.

``K`` RayClusters stay not ready (the KubeRay reactor holds their pods Pending) for a measured window
while, side by side in the same window against the same fake API server (tests/fakekube, real HTTP):

- ours: one ``RayClusterReadyTrigger`` per cluster (list once, then watch; the watch is re-opened
  every ``kuberay.watch.WATCH_SECONDS``, resuming from the last resourceVersion);
- polling: one poll loop per cluster, each poll reading exactly what a poke reads
  (``backend.cluster_status``: GET the RayCluster + list its pods, through the same client).

Every request is counted in the fake server's request log and attributed to its cluster (path,
``fieldSelector`` or ``labelSelector``). Counted honestly on both sides: our status read lists the
pods after the initial list and after every watch event, so those lists are counted for ours, and
each poll is counted as the GET plus the pods list it makes.

Scaling (stated in the JSON): by default ``WATCH_SECONDS`` is shortened from 240 s to 5 s by
monkeypatching ``airflow_provider_raytpu.backends.kuberay.watch.WATCH_SECONDS`` and the window is 60 s, so a
trigger re-opens its watch ~12 times; per hour at the real 240 s = startup requests (list + pods list)
+ watch requests per watch period x 3600 / 240. Polls are measured at a short interval (1 s) to count
requests per poll; per hour at interval I = 3600 / I x requests per poll. Run with
``--watch-seconds 240 --window 120`` for an unscaled (but short) window.

An idle cluster is the cheapest case for polling relative to watching: a cluster whose status changes
(hosts coming up one by one) costs ours one pods list per change, and polling nothing more.

Run: ``.venv/bin/python benchmarks/api_load.py [--clusters 10] [--window 60] [--watch-seconds 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import time
from typing import Any

import _common

_common.setup_airflow_env()

NS = _common.NAMESPACE
CONN = "raytpu_default"
REAL_WATCH_SECONDS = 240
POLL_INTERVALS = (5.0, 10.0, 30.0, 60.0)
_NAME_IN_PATH = re.compile(r"/rayclusters/([^/]+)")


def cluster_of(req: Any) -> str | None:
    """Which RayCluster a logged request is about."""
    m = _NAME_IN_PATH.search(req.path)
    if m:
        return m.group(1)
    for key, prefix in (("fieldSelector", "metadata.name="), ("labelSelector", "ray.io/cluster=")):
        value = req.query.get(key) or ""
        if value.startswith(prefix):
            return value[len(prefix):]
    return None


def kind_of(req: Any) -> str:
    if req.watch:
        return "watch rayclusters"
    if req.path.endswith("/pods"):
        return "list pods"
    if req.path.endswith("/rayclusters"):
        return "list rayclusters"
    if _NAME_IN_PATH.search(req.path):
        return "get raycluster"
    return f"{req.method} {req.path}"


async def run_trigger(name: str, deadline: float, events: list) -> None:
    from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger

    async for event in RayClusterReadyTrigger(name, NS, CONN, deadline).run():
        events.append(event.payload)
        return


async def poll_loop(backend: Any, name: str, interval: float, stop_at: float, polls: collections.Counter) -> None:
    from airflow_provider_raytpu.backends.kuberay.diagnosis import acluster_status

    async with backend.clients.async_api_client() as api:
        next_poll = time.monotonic()
        while time.monotonic() < stop_at:
            cluster = await backend.objects.aget(api, name, NS)
            status = await acluster_status(api, cluster)
            polls[name] += 1
            if status.finished:
                return
            next_poll += interval
            await asyncio.sleep(max(0.0, next_poll - time.monotonic()))


async def main_async(args: argparse.Namespace) -> _common.Result:
    import airflow_provider_raytpu.backends.kuberay.watch as kuberay_watch
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    scaled = args.watch_seconds != REAL_WATCH_SECONDS
    kuberay_watch.WATCH_SECONDS = args.watch_seconds
    result = _common.Result("api_load", {
        "clusters": args.clusters, "window_s": args.window, "watch_seconds_used": args.watch_seconds,
        "watch_seconds_real": REAL_WATCH_SECONDS, "scaled": scaled,
        "scaling": (f"kuberay.watch.WATCH_SECONDS monkeypatched {REAL_WATCH_SECONDS} -> {args.watch_seconds} s; "
                    f"per hour = startup + watch-period requests x 3600/{REAL_WATCH_SECONDS}") if scaled
        else "none: the real WATCH_SECONDS",
        "poll_interval_measured_s": args.poll_interval,
        "server": "tests/fakekube FakeKubeApiServer in-process (own thread), real HTTP on 127.0.0.1",
    })
    with _common.fake_kube(mode="hold") as (server, reactor):
        backend = RayTpuHook(CONN).backend
        ours = [f"watch-{i}" for i in range(args.clusters)]
        polled = [f"poll-{i}" for i in range(args.clusters)]
        for name in ours + polled:
            await asyncio.to_thread(backend.apply_cluster, _common.cluster_manifest(name))
        await asyncio.sleep(0.5)  # the reactor creates the pods (Pending) and writes the first status
        server.clear_log()
        t0 = time.monotonic()
        stop_at = t0 + args.window
        events: list = []
        polls: collections.Counter = collections.Counter()
        triggers = [asyncio.create_task(run_trigger(n, time.time() + args.window + 600, events)) for n in ours]
        pollers = [asyncio.create_task(poll_loop(backend, n, args.poll_interval, stop_at, polls)) for n in polled]
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        await asyncio.gather(*pollers)
        window = time.monotonic() - t0
        log = server.requests
        for t in triggers:
            t.cancel()
        await asyncio.gather(*triggers, return_exceptions=True)
        assert not events, f"a cluster was expected to stay not ready: {events[:1]}"

    per_cluster: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unattributed = collections.Counter()
    for req in log:
        name = cluster_of(req)
        if name is None:
            unattributed[kind_of(req)] += 1
        else:
            per_cluster[name][kind_of(req)] += 1

    def mean_counts(names: list[str]) -> dict[str, float]:
        kinds = {k for n in names for k in per_cluster[n]}
        return {k: sum(per_cluster[n][k] for n in names) / len(names) for k in sorted(kinds)}

    ours_counts, poll_counts = mean_counts(ours), mean_counts(polled)
    watch_periods = window / args.watch_seconds
    watches = ours_counts.get("watch rayclusters", 0.0)
    startup = sum(v for k, v in ours_counts.items() if k != "watch rayclusters")
    watch_per_period = watches / watch_periods
    ours_per_hour = startup + watch_per_period * 3600 / REAL_WATCH_SECONDS
    total_polls = sum(polls[n] for n in polled) / len(polled)
    requests_per_poll = sum(poll_counts.values()) / total_polls
    result["window_measured_s"] = window
    result["ours"] = {
        "requests_per_trigger_in_window": ours_counts,
        "startup_requests_per_trigger": startup,
        "watch_requests_per_watch_period": watch_per_period,
        "requests_per_sensor_hour": ours_per_hour,
        "how": "derived from the measured window: startup + watch requests per period x 3600/240",
    }
    result["polling"] = {
        "requests_per_loop_in_window": poll_counts,
        "polls_per_loop_in_window": total_polls,
        "requests_per_poll": requests_per_poll,
        "requests_per_sensor_hour": {f"{i:g}": 3600 / i * requests_per_poll for i in POLL_INTERVALS},
        "how": "requests per poll measured; per hour = 3600 / interval x requests per poll",
    }
    result["unattributed_requests"] = dict(unattributed)
    result["notes"] = [
        "per hour figures assume the cluster stays not ready all hour with no status change; each change "
        "(e.g. a host becoming ready) costs the watch trigger one pods list (and polling nothing extra)",
        "the watch stream stays open between requests: one long-lived connection per waiting trigger",
    ]
    for interval in POLL_INTERVALS:
        label = f"poll {interval:g} s" + (" (Airflow default poke)" if interval == 60 else "")
        result.add("API requests per waiting sensor-hour", ours_per_hour, 3600 / interval * requests_per_poll,
                   "requests", baseline_name=label,
                   how=(f"measured ({window:.0f} s window, re-watch every {args.watch_seconds:g} s), extrapolated to 1 h "
                        f"at {REAL_WATCH_SECONDS} s") if scaled else f"measured ({window:.0f} s), extrapolated to 1 h")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clusters", type=int, default=10, help="clusters for each side (triggers / poll loops)")
    parser.add_argument("--window", type=float, default=60.0, help="measured window in seconds")
    parser.add_argument("--watch-seconds", type=float, default=5.0,
                        help=f"WATCH_SECONDS during the run (real: {REAL_WATCH_SECONDS}); results are scaled to it")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="poll interval used to count requests per poll")
    args = parser.parse_args()
    _common.quiet_logs()
    result = asyncio.run(main_async(args))
    path = result.write()
    result.print_table()
    o, p = result["ours"], result["polling"]
    print(f"  ours per trigger in {result['window_measured_s']:.0f} s: {o['requests_per_trigger_in_window']}; "
          f"polling: {p['requests_per_poll']:.2f} requests per poll")
    print(f"  -> {path.relative_to(_common.REPO)}")


if __name__ == "__main__":
    main()
