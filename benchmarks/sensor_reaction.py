"""Sensor reaction: time from a status change on the API server to the waiting task's event.

Ours: ``RayClusterReadyTrigger`` / ``RayServiceRunningTrigger`` (list once, then watch) against the
fake Kubernetes API server (tests/support/fake_apiserver, real HTTP, in-process in its own thread). The change is

- RayCluster: the KubeRay reactor flipping the cluster to ready (its pods become ready ``delay``
  after ``set_mode("auto")``); the change time is the commit of the status write that makes it
  ready (an ``on_change`` callback on the server's loop);
- RayService: a status write with ``KubeRayReactor.set_service_status`` promoting the cluster
  (Ready, applications RUNNING); the change time is that commit.

Reaction = time the trigger yields its event - change time. N trials, median and p95.

Baseline: a poll loop at the intervals existing tools use (Airflow's default sensor
``poke_interval`` 60 s; 5 / 10 / 30 s polls). Each poll reads through the same Kubernetes client as
our trigger (kubernetes_asyncio through the cncf-kubernetes hook): GET the RayCluster and
``status.read_ray_cluster`` (what the cncf ``KubernetesJobTrigger`` does for a Job). For the
RayService: GET the service and its clusters, ``status.read_ray_service``. Its reaction is
(time of the first poll after the change that sees it) - change time.

Measured: poll loops at the shorter intervals run concurrently, one per RayCluster, each started at
a random phase, and one change lands on all clusters at once, so every loop sees it at a different
point of its period (trials of the same interval in one period of wall time). Derived: for long
intervals (60 s by default: waiting for it would take minutes), the expected reaction with the change
at a uniformly random phase is ``U(0, interval) + poll latency``: median interval/2 + latency, p95
0.95 x interval + latency, where the poll latency (one read) is measured. The table says which is which.

Run: ``.venv/bin/python benchmarks/sensor_reaction.py [--trials 20] [--measure 5,10,30] [--derive 60]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import _common

_common.setup_airflow_env()

NS = _common.NAMESPACE
CONN = "raytpu_default"
APP = {
    "name": "tiny-model",
    "import_path": "serving.model:build_app",
    "route_prefix": "/",
    "version_arg": "model_version",
}


async def wait_until(predicate: Any, timeout: float = 30.0, step: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(step)


async def first_event(trigger: Any) -> tuple[dict[str, Any], float]:
    async for event in trigger.run():
        return event.payload, time.monotonic()
    raise RuntimeError("the trigger ended without an event")


class ChangeClock:
    """Monotonic time of the commit that makes each RayCluster ready / each RayService serve."""

    def __init__(self, server: Any) -> None:
        self.cluster_ready: dict[str, float] = {}
        self.service_serving: dict[str, float] = {}
        self._unsubscribe = server.on_change(self._on_change)

    def _on_change(self, ev: Any) -> None:
        now = time.monotonic()
        if _common.is_ready_commit(ev):
            self.cluster_ready.setdefault(ev.name, now)
        elif ev.plural == "rayservices" and ev.type == "MODIFIED":
            active = ((ev.object.get("status") or {}).get("activeServiceStatus") or {})
            apps = active.get("applicationStatuses") or {}
            if active.get("rayClusterName") and apps and all(a.get("status") == "RUNNING" for a in apps.values()):
                self.service_serving.setdefault(ev.name, now)

    def close(self) -> None:
        self._unsubscribe()


# -- ours -----------------------------------------------------------------------------------------

async def ours_cluster(server: Any, reactor: Any, backend: Any, clock: ChangeClock, trials: int) -> list[float]:
    from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger

    reactions = []
    for i in range(trials):
        name = f"watch-{i}"
        await wait_until(lambda: server.open_watches == 0)
        await asyncio.to_thread(backend.apply_cluster, _common.cluster_manifest(name))
        trigger = RayClusterReadyTrigger(name, NS, CONN, time.time() + 60)
        task = asyncio.create_task(first_event(trigger))
        await wait_until(lambda task=task: server.open_watches == 1 or task.done())
        await asyncio.sleep(random.uniform(0.0, 0.1))
        reactor.set_mode("auto", cluster=name, namespace=NS)
        payload, fired = await task
        assert payload["status"] == "READY", payload
        reactions.append(fired - clock.cluster_ready[name])
        await asyncio.to_thread(backend.delete_cluster, name, NS)
    return reactions


class ServicePlay:
    """KubeRay's RayService controller for one service, as tests/support/rayservice_controller.py plays it."""

    def __init__(self, server: Any, reactor: Any, backend: Any, name: str) -> None:
        self.server, self.reactor, self.backend, self.name = server, reactor, backend, name
        self.cluster = ""

    def deploy_initializing(self) -> None:
        import copy

        from airflow_provider_raytpu.manifests.rayservice import build_ray_service
        from airflow_provider_raytpu.tpu import TpuSlice

        self.backend.services.apply_service(build_ray_service(name=self.name, namespace=NS, tpu=TpuSlice("v6e", "4x4"),
                                                     applications=[APP], version="v1"))
        service = self.server.get_object("rayservices", NS, self.name)
        self.cluster = f"{self.name}-c0001"
        self.server.create_object({
            "apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": self.cluster, "namespace": NS,
                         "labels": {**service["metadata"]["labels"], "ray.io/originated-from-cr-name": self.name,
                                    "ray.io/originated-from-crd": "RayService"},
                         "annotations": dict(service["metadata"]["annotations"])},
            "spec": copy.deepcopy(service["spec"]["rayClusterConfig"]),
        })
        self.reactor.set_service_status(
            self.name, NS, conditions={"Ready": (False, "Initializing"), "UpgradeInProgress": (False, "Initializing")},
            pending={APP["name"]: "DEPLOYING"}, pending_cluster=self.cluster)

    def promote(self) -> None:
        self.reactor.set_service_status(
            self.name, NS, conditions={"Ready": True, "UpgradeInProgress": False},
            active={APP["name"]: "RUNNING"}, active_cluster=self.cluster, pending={}, pending_cluster="",
            num_serve_endpoints=1)

    def delete(self) -> None:
        self.backend.services.delete_service(self.name, NS)
        self.backend.delete_cluster(self.cluster, NS)


async def ours_service(server: Any, reactor: Any, backend: Any, clock: ChangeClock, trials: int) -> list[float]:
    from airflow_provider_raytpu.triggers.rayservice import RayServiceRunningTrigger

    reactions = []
    for i in range(trials):
        play = ServicePlay(server, reactor, backend, f"svc-{i}")
        await wait_until(lambda: server.open_watches == 0)
        await asyncio.to_thread(play.deploy_initializing)
        trigger = RayServiceRunningTrigger(play.name, NS, CONN, time.time() + 60)
        task = asyncio.create_task(first_event(trigger))
        await wait_until(lambda task=task: server.open_watches == 1 or task.done())
        await asyncio.sleep(random.uniform(0.0, 0.1))
        await asyncio.to_thread(play.promote)
        payload, fired = await task
        assert payload["status"] == "RUNNING", payload
        reactions.append(fired - clock.service_serving[play.name])
        await asyncio.to_thread(play.delete)
    return reactions


# -- the poll loop ------------------------------------------------------------------------------------

async def poll_cluster_once(backend: Any, api: Any, name: str) -> Any:
    """One poll: GET the RayCluster and interpret it (what the cncf KubernetesJobTrigger does for a Job)."""
    from airflow_provider_raytpu.status import read_ray_cluster

    return read_ray_cluster(await backend.objects.aget(api, name, NS))


async def poll_until_ready(backend: Any, name: str, interval: float, start_at: float) -> tuple[float, list[float]]:
    """Poll every ``interval`` s from ``start_at`` (monotonic) until READY; returns (fired, read latencies)."""
    latencies = []
    async with backend.clients.async_api_client() as api:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        next_poll = time.monotonic()
        while True:
            t0 = time.monotonic()
            status = await poll_cluster_once(backend, api, name)
            done = time.monotonic()
            latencies.append(done - t0)
            if status.finished:
                return done, latencies
            next_poll += interval
            await asyncio.sleep(max(0.0, next_poll - time.monotonic()))


async def polled_reactions(server: Any, reactor: Any, backend: Any, clock: ChangeClock,
                           intervals: list[float], per_interval: int) -> tuple[dict[float, list[float]], list[float]]:
    """Concurrent poll loops at random phase, one RayCluster each; one change lands on all of them."""
    loops = [(interval, f"poll-{int(interval)}s-{k}") for interval in intervals for k in range(per_interval)]
    for _, name in loops:
        await asyncio.to_thread(backend.apply_cluster, _common.cluster_manifest(name))
    longest = max(intervals)
    change_at = time.monotonic() + longest + 1.0  # every loop polls at least once before the change
    tasks = {}
    for interval, name in loops:
        # First poll at a uniformly random phase of the period before the change (never after it).
        start = change_at - longest - 0.5 + random.uniform(0.0, interval)
        tasks[name] = (interval, asyncio.create_task(poll_until_ready(backend, name, interval, start)))
    await asyncio.sleep(max(0.0, change_at - time.monotonic()))
    reactor.set_mode("auto")  # one change for every cluster
    by_interval: dict[float, list[float]] = {i: [] for i in intervals}
    latencies: list[float] = []
    for name, (interval, task) in tasks.items():
        fired, lat = await task
        by_interval[interval].append(fired - clock.cluster_ready[name])
        latencies.extend(lat)
    reactor.set_mode("hold")
    for _, name in loops:
        await asyncio.to_thread(backend.delete_cluster, name, NS)
    return by_interval, latencies


async def service_poll_latency(server: Any, reactor: Any, backend: Any, reads: int) -> list[float]:
    """The cost of one RayService poll read (GET the service and its clusters, read_ray_service)."""
    play = ServicePlay(server, reactor, backend, "svc-poll")
    await asyncio.to_thread(play.deploy_initializing)
    latencies = []
    async with backend.clients.async_api_client() as api:
        for _ in range(reads):
            t0 = time.monotonic()
            service = await backend.services.objects.aget(api, play.name, NS)
            await backend.services._aread(api, service, None)
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(0.01)
    await asyncio.to_thread(play.delete)
    return latencies


def expected_poll_reaction(interval: float, latency: float) -> dict[str, float]:
    """Change at a uniformly random phase of the poll period: reaction = U(0, interval) + latency."""
    return {"median": interval / 2 + latency, "mean": interval / 2 + latency, "p95": 0.95 * interval + latency,
            "max": interval + latency}


async def main_async(args: argparse.Namespace) -> _common.Result:
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    measure = [float(x) for x in args.measure.split(",") if x]
    derive = [float(x) for x in args.derive.split(",") if x]
    result = _common.Result("sensor_reaction", {
        "trials": args.trials, "poll_loops_per_interval": args.poll_loops, "measured_intervals_s": measure,
        "derived_intervals_s": derive, "reactor_delay_s": args.delay, "cluster": "v6e 4x4 (4 hosts + head)",
        "server": "tests/support/fake_apiserver FakeKubeApiServer in-process (own thread), real HTTP on 127.0.0.1",
    })
    with _common.fake_kube(delay=args.delay, mode="hold") as (server, reactor):
        backend = RayTpuHook(CONN).backend
        clock = ChangeClock(server)
        t0 = time.monotonic()
        ours_rc = await ours_cluster(server, reactor, backend, clock, args.trials)
        ours_rs = await ours_service(server, reactor, backend, clock, args.trials)
        t_ours = time.monotonic() - t0
        polled, cluster_latencies = await polled_reactions(server, reactor, backend, clock, measure, args.poll_loops) \
            if measure else ({}, [])
        if not cluster_latencies:  # nothing measured at an interval: still measure the read latency
            _, cluster_latencies = await polled_reactions(server, reactor, backend, clock, [0.2], 5)
        svc_latencies = await service_poll_latency(server, reactor, backend, 20)
        clock.close()

    ours_rc_d, ours_rs_d = _common.describe(ours_rc), _common.describe(ours_rs)
    lat_rc, lat_rs = _common.describe(cluster_latencies), _common.describe(svc_latencies)
    result["ours"] = {"raycluster_reaction_s": ours_rc_d, "rayservice_reaction_s": ours_rs_d,
                      "raw_raycluster_s": ours_rc, "raw_rayservice_s": ours_rs, "wall_s": t_ours}
    result["poll_read_latency_s"] = {"raycluster": lat_rc, "rayservice": lat_rs}
    polls: dict[str, Any] = {}
    for interval in sorted(set(measure) | set(derive)):
        label = f"poll {interval:g} s" + (" (Airflow default poke)" if interval == 60 else "")
        entry: dict[str, Any] = {"derived": expected_poll_reaction(interval, lat_rc["median"]),
                                 "derived_rayservice": expected_poll_reaction(interval, lat_rs["median"])}
        if interval in polled:
            entry["measured"] = _common.describe(polled[interval])
            entry["raw_measured_s"] = polled[interval]
            rc, how, n = entry["measured"], "measured", f", n={entry['measured']['n']}"
        else:
            rc, how, n = entry["derived"], "ours measured, poll derived", ""
        result.add("RayCluster ready -> event, median", ours_rc_d["median"], rc["median"], "s",
                   baseline_name=label + n, how=how)
        result.add("RayCluster ready -> event, p95", ours_rc_d["p95"], rc["p95"], "s", baseline_name=label + n, how=how)
        rs = entry["derived_rayservice"]
        result.add("RayService serving -> event, median", ours_rs_d["median"], rs["median"], "s", baseline_name=label,
                   how="ours measured, poll derived")
        polls[f"{interval:g}"] = entry
    result["poll"] = polls
    result["notes"] = [
        "reaction = time the trigger (or poll loop) has the event - commit time of the status write on the "
        "fake API server (same process, time.monotonic)",
        "measured poll figures: concurrent poll loops at random phase, one RayCluster each, one change on all",
        "derived poll figures: U(0, interval) + measured median poll read latency (GET + "
        "read_ray_cluster; RayService: GET service + clusters + read_ray_service): median interval/2 + latency, "
        "p95 0.95*interval + latency",
        "a poke-mode sensor adds its worker's overhead on top; a deferrable sensor of either kind adds the same "
        "triggerer -> scheduler hand-off, not counted here",
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials of our triggers (each kind)")
    parser.add_argument("--measure", default="5,10,30", help="poll intervals (s) to measure, comma-separated")
    parser.add_argument("--derive", default="60", help="poll intervals (s) to derive analytically only")
    parser.add_argument("--poll-loops", type=int, default=12,
                        help="concurrent poll loops (trials) per measured interval")
    parser.add_argument("--delay", type=float, default=0.05, help="reactor: seconds until pods become ready")
    args = parser.parse_args()
    _common.quiet_logs()
    result = asyncio.run(main_async(args))
    path = result.write()
    result.print_table()
    print(f"  -> {path.relative_to(_common.REPO)}")


if __name__ == "__main__":
    main()
