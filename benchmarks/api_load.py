"""API load: requests to the Kubernetes API server per waiting sensor-hour, ours vs the cncf polling pattern.

For each size (10 and 100 sensors by default), RayClusters stay not ready (the KubeRay reactor
holds their pods Pending) while, against the same fake API server (tests/support/fake_apiserver, HTTPS with a
cluster CA, in this process's own thread), in one event loop:

- ours: one ``RayClusterReadyTrigger`` per cluster. Counted: the requests until every trigger
  has its first status (startup: list pages, the watch), the requests in a steady window, and
  the requests of one re-watch (the server ends every watch stream, as when ``timeoutSeconds``
  is up);
- baseline: the cncf-kubernetes ``KubernetesJobTrigger`` pattern: a cached
  ``AsyncKubernetesHook`` and, every 10 s (its default), one GET through ``hook.get_conn()``.
  Counted: requests per poll.

Per sensor-hour (derived from the measured counts and the watch period, ``WATCH_SECONDS`` =
3600 s, not patched): ours, first hour = (startup + steady rate x 1 h + re-watches in the hour
x requests per re-watch) / sensors, a later hour = (steady rate x 1 h + re-watches x requests
per re-watch) / sensors; baseline = requests per poll x 3600 / 10.

Run: ``.venv/bin/python benchmarks/api_load.py [--sizes 10,100] [--window 30]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from typing import Any

import _common

_common.setup_airflow_env()

NS = _common.NAMESPACE
CONN = "raytpu_default"
POLL_INTERVAL = 10.0


def counts(server: Any) -> collections.Counter:
    found: collections.Counter = collections.Counter()
    for req in server.requests:
        kind = "watch" if req.watch else ("list pods" if req.path.endswith("/pods") else
                                          "list rayclusters" if req.path.endswith("/rayclusters") else
                                          "get raycluster" if "/rayclusters/" in req.path else
                                          f"{req.method} {req.path}")
        found[kind] += 1
    return found


def diff(after: collections.Counter, before: collections.Counter) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] - before[k]}


async def ours(server: Any, names: list[str], window: float) -> dict[str, Any]:
    from _triggerer import FirstLine

    from airflow_provider_raytpu.backends.kuberay.informer import WATCH_SECONDS
    from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger

    seen: dict[str, float] = {}

    async def one(name: str) -> None:
        trigger = RayClusterReadyTrigger(name, NS, CONN, time.time() + 3600)
        trigger._log = FirstLine(name, seen)
        async for _ in trigger.run():
            raise AssertionError(f"{name} was expected to stay not ready")

    c0 = counts(server)
    tasks = [asyncio.create_task(one(n)) for n in names]
    while len(seen) < len(names) or server.open_watches < 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    c1 = counts(server)
    t0 = time.monotonic()
    await asyncio.sleep(window)
    steady_s = time.monotonic() - t0
    c2 = counts(server)
    server.end_watches()
    await asyncio.sleep(0.5)
    while server.open_watches < 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    c3 = counts(server)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    startup, steady, rewatch = diff(c1, c0), diff(c2, c1), diff(c3, c2)
    per_rewatch = sum(rewatch.values())
    rewatches_per_hour = 3600 / WATCH_SECONDS
    steady_per_hour = sum(steady.values()) / steady_s * 3600
    n = len(names)
    return {"startup_requests": startup, "steady_requests": steady, "steady_window_s": steady_s,
            "requests_per_rewatch": rewatch, "watch_seconds": WATCH_SECONDS,
            "first_hour_per_sensor": (sum(startup.values()) + steady_per_hour
                                      + (rewatches_per_hour - 1) * per_rewatch) / n,
            "later_hour_per_sensor": (steady_per_hour + rewatches_per_hour * per_rewatch) / n}


async def baseline(server: Any, names: list[str], polls: int) -> dict[str, Any]:
    from _triggerer import CncfPollingTrigger

    c0 = counts(server)
    seen: dict[str, float] = {}
    pollers = [CncfPollingTrigger(n, POLL_INTERVAL, seen) for n in names]
    tasks = [asyncio.create_task(p.run()) for p in pollers]
    await asyncio.sleep(POLL_INTERVAL * (polls - 1) + POLL_INTERVAL / 2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    made = diff(counts(server), c0)
    per_poll = sum(made.values()) / (len(names) * polls)
    return {"requests": made, "polls_per_sensor": polls, "requests_per_poll": per_poll,
            "per_sensor_hour": per_poll * 3600 / POLL_INTERVAL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100", help="waiting sensors, comma-separated")
    parser.add_argument("--window", type=float, default=30.0, help="steady window in seconds (ours)")
    parser.add_argument("--polls", type=int, default=3, help="polls per baseline sensor counted")
    args = parser.parse_args()
    _common.quiet_logs()
    from tests.support.fake_apiserver.kuberay import KubeRayReactor
    from tests.support.fake_apiserver.server import FakeKubeApiServer

    sizes = [int(x) for x in args.sizes.split(",") if x]
    result = _common.Result("api_load", {
        "sizes": sizes, "window_s": args.window, "baseline_polls": args.polls,
        "server": "tests/support/fake_apiserver FakeKubeApiServer over HTTPS (trustme CA in the kubeconfig), in this "
                  "process's own thread, a bookmark every 60 s; clusters v6e 2x2 held Pending by the KubeRay reactor",
        "baseline": "the cncf-kubernetes KubernetesJobTrigger pattern: a cached AsyncKubernetesHook, one GET through "
                    f"get_conn() every {POLL_INTERVAL:g} s (its default poll_interval)",
    })
    runs = {}
    for n in sizes:
        with FakeKubeApiServer(tls=True, bookmark_interval=60.0) as server, \
                KubeRayReactor(server, delay=0.05, mode="hold"):
            _common.point_connections_at(server.airflow_connection(NS), NS)
            from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

            backend = RayTpuHook(CONN).backend
            names = [f"rc-{i:03d}" for i in range(n)]
            for name in names:
                backend.apply_cluster(_common.cluster_manifest(name, topology="2x2"))
            time.sleep(0.5)
            runs[n] = {"ours": asyncio.run(ours(server, names, args.window)),
                       "baseline": asyncio.run(baseline(server, names[: min(n, 20)], args.polls))}
        o, b = runs[n]["ours"], runs[n]["baseline"]
        label = f"cncf KubernetesJobTrigger pattern, {POLL_INTERVAL:g} s"
        how = (f"derived: measured startup, steady ({o['steady_window_s']:.0f} s) and re-watch counts, "
               f"{3600 / o['watch_seconds']:g} re-watch(es) per hour (WATCH_SECONDS {o['watch_seconds']} s)")
        result.add(f"{n} sensors: API requests per sensor-hour, first hour", o["first_hour_per_sensor"],
                   b["per_sensor_hour"], "requests", baseline_name=label, how=how)
        result.add(f"{n} sensors: API requests per sensor-hour, each later hour", o["later_hour_per_sensor"],
                   b["per_sensor_hour"], "requests", baseline_name=label, how=how)
        result.add(f"{n} sensors: requests until all are watching", sum(o["startup_requests"].values()), None,
                   "requests", baseline_name="")
        result.add(f"{n} sensors: requests in the steady window", sum(o["steady_requests"].values()), None,
                   "requests", baseline_name="")
        result.add(f"{n} sensors: requests of one re-watch", sum(o["requests_per_rewatch"].values()), None,
                   "requests", baseline_name="")
    result["runs"] = {str(n): r for n, r in runs.items()}
    for n, bound in ((10, 0.2), (100, 0.05)):
        if n in runs:
            o = runs[n]["ours"]
            result.goal(f"<= {bound} API requests per sensor-hour at {n} sensors",
                        [("first hour", o["first_hour_per_sensor"], bound, ""),
                         ("later hours", o["later_hour_per_sensor"], bound, "")],
                        how="derived (measured counts, the one-hour watch period)")
    result.finish()


if __name__ == "__main__":
    main()
