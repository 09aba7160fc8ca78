"""Triggerer capacity: one process, one event loop, many RayCluster sensors waiting at once.

As Airflow's triggerer does, one process runs every trigger as a task on one event loop
(benchmarks/_triggerer.py). The fake Kubernetes API server runs in another process
(benchmarks/_kube_server.py), over HTTPS with the cluster CA in the kubeconfig as real clusters
are (``--transports tls,http`` adds plain HTTP as a second row). Ours (``watch``,
``RayClusterReadyTrigger``) against the cncf-kubernetes ``KubernetesJobTrigger``'s pattern
(``poll``: a cached ``AsyncKubernetesHook``, one read through ``get_conn()`` every 10 s, its default).

Each run, in fresh processes:

1. **triggerer restart**: every trigger starts at once; time until each has read its cluster's
   first status (and, for ours, the watch is open), and the loop's lag meanwhile;
2. **steady**: a window with nothing happening: RSS (the floor, measured in the same process
   before the first trigger, is reported apart), CPU, API requests;
3. **re-watch** (ours): the server ends every watch stream as it does when ``timeoutSeconds``
   is up; the lag over steady + re-watch is the lag over a full re-watch period (its idle hour
   is the steady window's kind of time);
4. **all ready at once**: the server writes every cluster's ready state in one pass; time until
   all have fired and each trigger's reaction to its own cluster's commit.

``watch-restart`` (its own run): after the steady window the server drops every connection and
watch (an API server restart, state kept) and at once makes every cluster ready: the loop's lag
until all have fired, and whether any trigger missed its event.

Run: ``.venv/bin/python benchmarks/triggerer_capacity.py [--sizes 200,1000] [--transports tls,http]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import _common

_common.setup_airflow_env()

from _kube_server import server_main  # noqa: E402
from _triggerer import triggerer_main  # noqa: E402


def ask(conn: Any, *msg: Any, timeout: float = 600.0) -> Any:
    conn.send(msg)
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {msg[0]!r} within {timeout} s")
    return conn.recv()


def requests_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {verb: after.get(verb, 0) - before.get(verb, 0) for verb in after
            if after.get(verb, 0) != before.get(verb, 0)}


def run_one(variant: str, clusters: int, tls: bool, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(s_child, clusters, args.delay, tls), daemon=True)
    server.start()
    trig = None
    try:
        if not s_parent.poll(900):
            raise TimeoutError("the API server process did not start")
        _, kube_connection = s_parent.recv()
        t_parent, t_child = ctx.Pipe()
        kind = "poll" if variant == "poll" else "watch"
        trig = ctx.Process(target=triggerer_main, args=(t_child, kube_connection, kind, clusters, args.poll_interval,
                                                        variant == "watch-collected"), daemon=True)
        trig.start()
        if not t_parent.poll(300):
            raise TimeoutError("the triggerer process did not start")
        _, floor_rss = t_parent.recv()
        conns0 = ask(s_parent, "connections")
        out: dict[str, Any] = {"variant": variant, "triggers": clusters, "transport": "tls" if tls else "http",
                               "floor_rss_mib": floor_rss / 2**20}
        # 1. a triggerer restart: every trigger starts at once
        t_start = ask(t_parent, "start")
        deadline = time.time() + args.establish_timeout
        while True:
            status = ask(t_parent, "status")
            watching = kind == "poll" or ask(s_parent, "open_watches") >= 1
            if status["seen"] >= clusters and watching:
                break
            if status["errors"]:
                raise RuntimeError(f"triggers failed: {status['errors']}")
            if time.time() > deadline:
                raise TimeoutError(f"only {status['seen']} of {clusters} watching after {args.establish_timeout} s")
            time.sleep(0.05)
        t_watching = time.time()
        out["all_watching_s"] = t_watching - t_start
        time.sleep(1.0)
        out["restart_lag"] = ask(t_parent, "lag", t_start, time.time())
        out["connections_opened_to_establish"] = ask(s_parent, "connections")["opened"] - conns0["opened"]
        # 2. steady
        s0, r0 = ask(t_parent, "snapshot"), ask(s_parent, "requests")
        time.sleep(args.steady)
        s1, r1 = ask(t_parent, "snapshot"), ask(s_parent, "requests")
        window = s1["time"] - s0["time"]
        out.update({
            "steady_window_s": window, "rss_mib": s1["rss"] / 2**20,
            "rss_per_sensor_kib": (s1["rss"] - floor_rss) / clusters / 1024,
            "steady_cpu_percent": (s1["cpu_seconds"] - s0["cpu_seconds"]) / window * 100,
            "steady_requests": requests_between(r0, r1),
            "steady_requests_per_s": sum(requests_between(r0, r1).values()) / window,
            "steady_lag": ask(t_parent, "lag", s0["time"], s1["time"]), "open_fds": s1["open_fds"],
            "open_connections": ask(s_parent, "connections")["open"],
        })
        # 3. a re-watch, as at the end of timeoutSeconds (ours)
        if kind == "watch":
            t_end = ask(s_parent, "end_watches")
            time.sleep(0.3)
            while ask(s_parent, "open_watches") < 1 and time.time() - t_end < 60:
                time.sleep(0.05)
            time.sleep(2.0)
            out["rewatch_requests"] = requests_between(r1, ask(s_parent, "requests"))
            out["rewatch_lag"] = ask(t_parent, "lag", t_end, time.time())
        out["period_lag"] = ask(t_parent, "lag", s0["time"], time.time())
        # 4. every cluster ready at once (after an API server restart, for watch-restart)
        if variant == "watch-restart":
            t_restart, dropped = ask(s_parent, "restart")
            out["restart_connections_dropped"] = dropped
        flip = ask(s_parent, "flip")
        done = ask(t_parent, "wait_all", args.fire_timeout, timeout=args.fire_timeout + 60)
        ready_times = ask(s_parent, "ready_times")
        fired = done["fired"]
        reactions = [fired[n] - ready_times[n] for n in fired if n in ready_times]
        out.update({
            "fired": len(fired), "statuses": done["statuses"], "errors": done["errors"],
            "error_count": done["error_count"], "missed": clusters - len(fired),
            "fire_all_after_switch_s": (max(fired.values()) - flip) if fired else None,
            "last_ready_commit_after_switch_s": (max(ready_times.values()) - flip) if ready_times else None,
            "reaction_s": _common.describe(reactions),
            "firing_lag": ask(t_parent, "lag", flip if variant != "watch-restart" else t_restart, done["time"]),
            "firing_requests": requests_between(r1, ask(s_parent, "requests")),
        })
        ask(t_parent, "stop", timeout=120)
        ask(s_parent, "stop", timeout=60)
        return out
    finally:
        for p in (trig, server):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join(5)


def summarise(result: _common.Result, runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by = {(r["variant"], r["triggers"], r["transport"]): r for r in runs if "error" not in r}
    pl = f"cncf KubernetesJobTrigger pattern, {args.poll_interval:g} s"
    sizes = sorted({r["triggers"] for r in by.values()})
    for transport in ("tls", "http"):
        for n in sizes:
            w, p = by.get(("watch", n, transport)), by.get(("poll", n, transport))
            if w is None:
                continue
            tag = f"{n} sensors, {transport.upper()}"

            def row(metric: str, key: Any, unit: str, *, w: Any = w, p: Any = p, tag: str = tag, **kw: Any) -> None:
                ours = key(w)
                base = key(p) if p is not None else None
                result.add(f"{tag}: {metric}", ours, base, unit, baseline_name=pl if p is not None else "", **kw)

            row("process RSS", lambda r: r["rss_mib"], "MiB")
            row("fixed floor (interpreter, Airflow, Kubernetes clients)", lambda r: r["floor_rss_mib"], "MiB")
            row("RSS per sensor above the floor", lambda r: r["rss_per_sensor_kib"], "KiB")
            row("time until all are watching (triggerer restart)", lambda r: r["all_watching_s"], "s")
            row("loop lag max, triggerer restart", lambda r: r["restart_lag"].get("max_ms"), "ms")
            row("its longest garbage collection (a full one: the whole heap, Airflow's included)",
                lambda r: r["restart_lag"].get("gc_max_ms"), "ms")
            row("time blocked > 100 ms, triggerer restart",
                lambda r: r["restart_lag"].get("blocked_over_100ms_share", 0) * 100, "% of the phase")
            row("loop lag max over a re-watch period (steady + re-watch; poll: 3 polls)",
                lambda r: r["period_lag"].get("max_ms"), "ms")
            row("time blocked > 100 ms over that period",
                lambda r: r["period_lag"].get("blocked_over_100ms_share", 0) * 100, "% of the period")
            row("CPU, steady", lambda r: r["steady_cpu_percent"], "% of a core")
            row("API requests/s, steady", lambda r: r["steady_requests_per_s"], "req/s")
            row("all fired, after the switch", lambda r: r["fire_all_after_switch_s"], "s")
            row("reaction to its cluster's ready commit, p95", lambda r: r["reaction_s"].get("p95"), "s")
            row("reaction to its cluster's ready commit, max", lambda r: r["reaction_s"].get("max"), "s")
        small, large = (by.get(("watch", n, transport)) for n in (min(sizes), max(sizes)))
        if small and large and small is not large:
            marginal = (large["rss_mib"] - small["rss_mib"]) * 1024 / (large["triggers"] - small["triggers"])
            result.add(f"{transport.upper()}: RSS per additional sensor ({small['triggers']} -> {large['triggers']})",
                       marginal, None, "KiB", baseline_name="", how="derived (difference of two measured runs)")
            result["marginal_rss_kib_" + transport] = marginal
    for (variant, n, transport), r in sorted(by.items()):
        if variant == "watch-collected":
            tag = f"{n} sensors, {transport.upper()}, startup garbage collected before the first trigger"
            result.add(f"{tag}: loop lag max, triggerer restart", r["restart_lag"].get("max_ms"), None, "ms",
                       baseline_name="")
            result.add(f"{tag}: loop lag max, all ready at once", r["firing_lag"].get("max_ms"), None, "ms",
                       baseline_name="")
        if variant != "watch-restart":
            continue
        tag = f"{n} sensors, {transport.upper()}, API server restart + all ready at once"
        result.add(f"{tag}: loop lag max", r["firing_lag"].get("max_ms"), None, "ms", baseline_name="")
        result.add(f"{tag}: triggers that missed their event", r["missed"], None, "", baseline_name="")
        result.add(f"{tag}: all fired, after the switch", r["fire_all_after_switch_s"], None, "s", baseline_name="")


def goals(result: _common.Result, runs: list[dict[str, Any]]) -> None:
    by = {(r["variant"], r["triggers"], r["transport"]): r for r in runs if "error" not in r}
    w = by.get(("watch", 1000, "tls"))
    if w is not None:
        result.goal("1000 sensors over TLS: total RSS <= 300 MB including the floor",
                    [("RSS", w["rss_mib"] * 2**20 / 1e6, 300, "MB")],
                    note=f"floor {w['floor_rss_mib'] * 2**20 / 1e6:.0f} MB")
        marginal = result.data.get("marginal_rss_kib_tls")
        if marginal is not None:
            result.goal("<= 50 KiB per additional sensor", [("200 -> 1000 sensors", marginal, 50, "KiB")],
                        how="derived (difference of two measured runs)")
        result.goal("all watching within 5 s of start", [("all watching after", w["all_watching_s"], 5, "s")])
        react = w["reaction_s"]
        result.goal("all 1000 fired <= 3 s after their clusters turn ready at once, p95 reaction <= 1 s",
                    [("max reaction", react.get("max"), 3, "s"), ("p95", react.get("p95"), 1, "s"),
                     ("not fired", w["missed"], 0, "")],
                    note=f"reaction = event - its cluster's ready commit; the server's writes of all 1000 took "
                         f"{w['last_ready_commit_after_switch_s']:.2f} s")
        collected = by.get(("watch-collected", 1000, "tls"))
        result.goal("a triggerer restart with 1000 sensors: loop lag max <= 100 ms",
                    [("lag max", w["restart_lag"].get("max_ms"), 100, "ms")],
                    note=f"a fresh interpreter; its longest garbage collection "
                         f"{w['restart_lag'].get('gc_max_ms', 0):.0f}"
                         " ms" + (f"; {collected['restart_lag'].get('max_ms', float('nan')):.0f} ms with the startup "
                                  "garbage collected before" if collected else ""))
    r = by.get(("watch-restart", 1000, "tls"))
    if r is not None:
        result.goal("an API-server restart: loop lag max <= 100 ms, no event missed",
                    [("lag max", r["firing_lag"].get("max_ms"), 100, "ms"), ("missed", r["missed"], 0, "")],
                    note="every connection and watch dropped, then every cluster made ready at once; lag until "
                         "all fired")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="200,1000", help="concurrent sensors, comma-separated")
    parser.add_argument("--variants", default="watch,poll,watch-restart,watch-collected",
                        help="watch (ours), poll (the cncf KubernetesJobTrigger pattern), watch-restart (ours, with "
                             "an API server restart before the switch), watch-collected (ours, the triggerer's startup "
                             "garbage collected once before the first trigger)")
    parser.add_argument("--transports", default="tls,http", help="tls (a cluster CA in the kubeconfig), http")
    parser.add_argument("--http-sizes", default="1000", help="sizes run over plain HTTP too")
    parser.add_argument("--restart-sizes", default="1000", help="sizes of the watch-restart and watch-collected runs")
    parser.add_argument("--steady", type=float, default=30.0, help="seconds of steady state measured")
    parser.add_argument("--poll-interval", type=float, default=10.0,
                        help="the baseline's interval (KubernetesJobTrigger's default) and ours when not watching")
    parser.add_argument("--delay", type=float, default=0.05,
                        help="reactor: seconds until the template's pods are ready")
    parser.add_argument("--establish-timeout", type=float, default=300.0)
    parser.add_argument("--fire-timeout", type=float, default=300.0)
    args = parser.parse_args()
    _common.quiet_logs()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    transports = [t for t in args.transports.split(",") if t]
    http_sizes = {int(x) for x in args.http_sizes.split(",") if x}
    restart_sizes = {int(x) for x in args.restart_sizes.split(",") if x}
    result = _common.Result("triggerer_capacity", {
        "sizes": sizes, "variants": variants, "transports": transports, "steady_window_s": args.steady,
        "poll_interval_s": args.poll_interval, "lag_ticker_s": 0.01, "cluster": "v6e 2x2 (head + 1 host)",
        "baseline": "the cncf-kubernetes KubernetesJobTrigger pattern: a cached AsyncKubernetesHook, every "
                    f"poll_interval ({args.poll_interval:g} s, its default) one GET through hook.get_conn() (a new "
                    "ApiClient per read, as AsyncKubernetesHook.get_job_status); all started together, as after a "
                    "triggerer restart",
        "processes": "fake API server (+ reactor for the template) in one process, triggerer in another, both "
                     "spawned fresh per run; the server sends a bookmark every 60 s, as a real one does",
        "fd_soft_limit": _common.raise_fd_limit(),
    })
    plan = [(v, n, t) for t in transports for n in sizes for v in variants
            if (t == "tls" or n in http_sizes)
            and (v not in ("watch-restart", "watch-collected") or (n in restart_sizes and t == "tls"))]
    runs: list[dict[str, Any]] = []
    for variant, n, transport in plan:
        print(f"  running {variant} x {n} over {transport} ...", flush=True)
        try:
            runs.append(run_one(variant, n, transport == "tls", args))
        except Exception as exc:
            runs.append({"variant": variant, "triggers": n, "transport": transport,
                         "error": f"{type(exc).__name__}: {exc}"})
            print(f"    failed: {exc}", flush=True)
    result["runs"] = runs
    summarise(result, runs, args)
    goals(result, runs)
    result["notes"] = [
        "RSS per sensor = (RSS after establishment - the floor) / sensors; the floor is the same process before its "
        "first trigger, with Airflow's trigger runner, the provider and both Kubernetes clients imported",
        "loop lag = how late a ticker task sleeping 10 ms woke; 'blocked > 100 ms' = the summed lag of ticks later "
        "than 100 ms over the phase's length",
        "reaction = the trigger's event - the commit of its cluster's ready state on the server",
        "not measured here: the triggerer's supervisor process, its database polling and the writing of each "
        "trigger's log lines to its task's log (a real triggerer does these for every trigger alike)",
    ]
    result.finish()


if __name__ == "__main__":
    main()
