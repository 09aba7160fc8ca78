"""Job triggers at scale: status requests per cluster per tick, and bytes moved to follow a long job log.

The Ray dashboards are tests/support/jobs_stub.py (Ray's Jobs REST API and its streaming log tail,
with Ray's framing: the log from the start in messages of at most 10 lines, then new lines as
they come), behind the fake Kubernetes API server's service proxy over HTTPS, as a KubeRay
cluster's dashboard is reached by default. Bytes are counted on the wire, by a TCP relay between
the triggerer's loop and the API server (TLS, HTTP and WebSocket framing included).

1. ``--jobs`` job triggers (200) on ``--clusters`` clusters (10), every job writing a line every
   0.5 s for ``--window`` seconds: GET /api/jobs/ requests per cluster per tick (ours), against
   the provider's previous pattern, which is how Ray's ``JobSubmissionClient`` is used to follow
   a job (``get_job_info`` + ``get_job_logs`` per job per tick). Every cluster runs Ray's token
   authentication (its RayCluster names it, its Secret holds the token, its dashboard refuses
   requests without it), so the count of all API server requests per followed job per minute
   includes what reading the token costs.
2. One job whose log grows to ``--lines`` lines (100,000, ~7 MiB) over ``--log-seconds``: bytes
   on the wire against the log's size, and whether each line was written once, in order, for a
   deferred task (the triggerer) and for one that does not defer (the worker, Airflow's default
   ``default_deferrable = false``); the baseline reads the whole log every tick, as the
   non-deferrable path did up to 2138e50.

Run: ``.venv/bin/python benchmarks/job_load.py [--jobs 200] [--clusters 10] [--lines 100000]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

import _common

_common.setup_airflow_env()

NS = _common.NAMESPACE
CONN = "raytpu_default"
TICK = 2.0


class Relay:
    """A TCP relay on 127.0.0.1 in its own thread, counting the bytes each way."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.to_client = 0
        self.to_server = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, inbound: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if inbound:
                        self.to_client += len(data)
                    else:
                        self.to_server += len(data)
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(pump(client_r, server_w, False), pump(server_r, client_w, True))

        async def start() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(start())
        started.set()
        self._loop.run_forever()

    def reset(self) -> None:
        self.to_client = self.to_server = 0


class Lines:
    """Stands in for a trigger's logger: keeps the job's lines it writes."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        if message == "%s %s" and args[0] == "[ray job]":  # RayJobTrigger._write
            self.lines.append(args[1])

    warning = error = debug = exception = info


def connection_through(server: Any, relay: Relay) -> str:
    config = server.kubeconfig_dict(NS)
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    return json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(config), "namespace": NS}})


async def follow_ours(submission_id: str, cluster: str, log: Any = None) -> dict[str, Any]:
    from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger

    trigger = RayJobTrigger(submission_id, cluster, NS, CONN, poll_interval=TICK)
    if log is not None:
        trigger._log = log
    else:
        trigger._log = Lines()
    async for event in trigger.run():
        return event.payload
    raise AssertionError("no event")


def follow_in_worker(submission_id: str, cluster: str, log: Any) -> dict[str, Any]:
    """What ``SubmitRayJobOperator`` runs when it does not defer (in the worker's thread, its own event loop)."""
    from airflow_provider_raytpu.operators.ray_job import follow_here
    from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger

    trigger = RayJobTrigger(submission_id, cluster, NS, CONN, poll_interval=TICK)
    trigger._log = log
    return follow_here(trigger)


async def follow_per_job(submission_id: str, cluster: str, lines: list[str] | None = None) -> dict[str, Any]:
    """The previous pattern: GET the job and GET its whole log every tick, write what is new."""
    from airflow_provider_raytpu.hooks.ray_jobs import TERMINAL, RayJobsHook

    hook = RayJobsHook(cluster, NS, CONN)
    written = 0
    while True:
        status, message = await hook.astatus(submission_id)
        logs = await hook.alogs(submission_id)
        new = logs[written:] if status in TERMINAL else logs[written: logs.rfind("\n") + 1]
        if lines is not None:
            lines.extend(new.splitlines())
        written += len(new)
        if status in TERMINAL:
            return {"status": status}
        await asyncio.sleep(TICK)


def setup(server: Any, jobs: Any, clusters: list[str]) -> None:
    import base64

    for cluster in clusters:
        token = f"token-of-{cluster}"
        jobs.tokens[cluster] = token
        server.create_object({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                              "metadata": {"name": cluster, "namespace": NS},
                              "spec": {"rayVersion": "2.60.0", "authOptions": {"mode": "token"},
                                       "headGroupSpec": {"template": {"spec": {"containers": []}}}}})
        server.create_object({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": cluster, "namespace": NS},
                              "data": {"auth_token": base64.b64encode(token.encode()).decode()}})
        server.create_object({"apiVersion": "v1", "kind": "Service",
                              "metadata": {"name": f"{cluster}-head-svc", "namespace": NS},
                              "spec": {"ports": [{"name": "dashboard", "port": 8265}]}})
        server.register_service_proxy(NS, f"{cluster}-head-svc", "dashboard", jobs.url_for(cluster))


async def many_jobs(server: Any, jobs: Any, clusters: list[str], per_cluster: int, window: float,
                    variant: str) -> dict[str, Any]:
    ids = [(c, f"{variant}-{c}-{i}") for c in clusters for i in range(per_cluster)]
    for cluster, job in ids:
        jobs.add(cluster, job, log="started\n")
    follow = follow_ours if variant == "ours" else follow_per_job
    tasks = [asyncio.create_task(follow(job, cluster)) for cluster, job in ids]
    await asyncio.sleep(TICK * 2)
    before = dict(jobs.requests)
    api_before = server.count()
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < window:
        step += 1
        for cluster, job in ids:
            jobs.append(cluster, job, f"step {step}\n")
        await asyncio.sleep(0.5)
    took = time.monotonic() - started
    made = {k: v - before.get(k, 0) for k, v in jobs.requests.items() if v - before.get(k, 0)}
    api_requests = server.count() - api_before
    for cluster, job in ids:
        jobs.finish(cluster, job)
    events = await asyncio.gather(*tasks)
    ticks = took / TICK
    status_requests = sum(v for (c, route), v in made.items() if route in ("list", "get"))
    return {"jobs": len(ids), "window_s": took, "ticks": ticks,
            "requests": {f"{c} {r}": v for (c, r), v in made.items()},
            "status_requests_per_cluster_per_tick": status_requests / len(clusters) / ticks,
            "log_downloads_per_job_per_tick": sum(v for (c, r), v in made.items() if r == "logs") / len(ids) / ticks,
            "api_requests": api_requests, "api_requests_per_job_per_minute": api_requests / len(ids) / (took / 60),
            "statuses": sorted({e["status"] for e in events})}


async def long_log(jobs: Any, relay: Relay, lines: int, seconds: float, variant: str) -> dict[str, Any]:
    job = f"long-{variant}"
    jobs.add("c00", job)
    written = Lines()
    follow = {"ours": lambda: follow_ours(job, "c00", written),
              "worker": lambda: asyncio.to_thread(follow_in_worker, job, "c00", written),
              "per-job": lambda: follow_per_job(job, "c00", written.lines)}[variant]
    task = asyncio.create_task(follow())
    await asyncio.sleep(TICK)
    relay.reset()
    text_size = 0
    batches = max(1, int(seconds / 0.25))
    per_batch = lines // batches
    for b in range(batches):
        count = per_batch if b < batches - 1 else lines - per_batch * (batches - 1)
        chunk = "".join(f"step {b * per_batch + i:06d} loss=0.{(b * per_batch + i) % 997:06d} "
                        f"throughput=1234.5 rows/s shard=7/8\n" for i in range(count))
        text_size += len(chunk.encode())
        jobs.append("c00", job, chunk)
        await asyncio.sleep(0.25)
    jobs.finish("c00", job)
    await task
    expected = [f"step {i:06d} loss=0.{i % 997:06d} throughput=1234.5 rows/s shard=7/8" for i in range(lines)]
    return {"log_bytes": text_size, "lines": lines, "bytes_to_triggerer": relay.to_client,
            "bytes_from_triggerer": relay.to_server, "wire_over_log": relay.to_client / text_size,
            "each_line_once_in_order": written.lines == expected, "lines_written": len(written.lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--log-seconds", type=float, default=20.0)
    args = parser.parse_args()
    _common.quiet_logs()
    from tests.support.fake_apiserver.server import FakeKubeApiServer
    from tests.support.jobs_stub import JobsStub

    result = _common.Result("job_load", {**vars(args), "tick_s": TICK, "transport": "HTTPS through the fake API "
                                         "server's service proxy; bytes counted by a TCP relay before the API server"})
    clusters = [f"c{i:02d}" for i in range(args.clusters)]
    with FakeKubeApiServer(tls=True) as server, JobsStub(tail_sleep=0.2) as jobs:
        relay = Relay(server.port)
        _common.point_connections_at(connection_through(server, relay), NS)
        setup(server, jobs, clusters)
        per_cluster = args.jobs // args.clusters
        data = {variant: asyncio.run(many_jobs(server, jobs, clusters, per_cluster, args.window, variant))
                for variant in ("ours", "per-job")}
        logs = {variant: asyncio.run(long_log(jobs, relay, args.lines, args.log_seconds, variant))
                for variant in ("ours", "worker", "per-job")}
    result["many_jobs"], result["long_log"] = data, logs
    base = "per job: status + whole log every 2 s, as the previous trigger"
    o, b = data["ours"], data["per-job"]
    tag = f"{o['jobs']} job sensors on {args.clusters} clusters"
    result.add(f"{tag}: status requests per cluster per tick", o["status_requests_per_cluster_per_tick"],
               b["status_requests_per_cluster_per_tick"], "requests", baseline_name=base)
    result.add(f"{tag}, Ray token authentication: API server requests per followed job per minute",
               o["api_requests_per_job_per_minute"], b["api_requests_per_job_per_minute"], "requests",
               baseline_name=base)
    result.add(f"{tag}: whole-log downloads per job per tick", o["log_downloads_per_job_per_tick"],
               b["log_downloads_per_job_per_tick"], "requests", baseline_name=base)
    lo, lw, lb = logs["ours"], logs["worker"], logs["per-job"]
    log_tag = f"a {args.lines:,}-line job log ({lo['log_bytes'] / 2**20:.1f} MiB)"
    result.add(f"{log_tag}: bytes to the triggerer / log size", lo["wire_over_log"], lb["wire_over_log"], "x",
               baseline_name=base)
    result.add("... each line written once, in order", float(lo["each_line_once_in_order"]),
               float(lb["each_line_once_in_order"]), "1 = yes", baseline_name=base, lower_is_better=False)
    worker_base = "status + whole log every 2 s, as the task that did not defer did before"
    result.add(f"{log_tag}, a task that does not defer: bytes to the worker / log size", lw["wire_over_log"],
               lb["wire_over_log"], "x", baseline_name=worker_base)
    result.add("... each line written once, in order (not deferred)", float(lw["each_line_once_in_order"]),
               float(lb["each_line_once_in_order"]), "1 = yes", baseline_name=worker_base, lower_is_better=False)
    result.goal(f"{o['jobs']} job sensors on {args.clusters} clusters: <= 1 status request per cluster per tick",
                [("status requests per cluster per tick", o["status_requests_per_cluster_per_tick"], 1, "")])
    result.goal(f"a {args.lines:,}-line job log: bytes transferred <= 1.5x its size, each line once",
                [("bytes on the wire / log size", lo["wire_over_log"], 1.5, "x"),
                 ("lines not written exactly once in order", 0.0 if lo["each_line_once_in_order"] else 1.0, 0, "")],
                note="TLS, HTTP and WebSocket framing included")
    result.goal(f"a {args.lines:,}-line job log, a task that does not defer: bytes transferred <= 1.5x its size, "
                "each line once",
                [("bytes on the wire / log size", lw["wire_over_log"], 1.5, "x"),
                 ("lines not written exactly once in order", 0.0 if lw["each_line_once_in_order"] else 1.0, 0, "")],
                note="TLS, HTTP and WebSocket framing included")
    result.finish()


if __name__ == "__main__":
    main()
