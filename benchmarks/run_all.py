"""Run every benchmark (each in its own interpreter, one after the other) and write docs/benchmarks.md.

``make bench`` runs this. Each benchmark writes ``benchmarks/results/<name>.json``; the markdown
table has the latest figures of every benchmark that has a result file (this run's, or an earlier
one's when ``--only``/``--skip`` left it out: each says when it ran, with which command and the load
average at its start).

Run: ``.venv/bin/python benchmarks/run_all.py [--only a,b] [--skip c] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import _common

DOC = _common.REPO / "docs" / "benchmarks.md"

# name -> (what it compares, extra args for --quick)
BENCHMARKS: dict[str, tuple[str, list[str]]] = {
    "sensor_reaction": ("status change -> trigger event: watch trigger vs polling at 5/10/30/60 s",
                        ["--trials", "5", "--measure", "2", "--derive", "5,10,30,60", "--poll-loops", "4"]),
    "api_load": ("API requests per waiting sensor-hour at 10 / 100 sensors: ours vs the cncf polling pattern",
                 ["--sizes", "10", "--window", "3", "--polls", "2"]),
    "triggerer_capacity": ("one triggerer process with 200 / 1000 RayCluster sensors over TLS (and HTTP): ours vs the "
                           "cncf KubernetesJobTrigger pattern",
                           ["--sizes", "50", "--steady", "3", "--http-sizes", "50", "--restart-sizes", "50"]),
    "triggerer_runner": ("1000 RayCluster sensors in Airflow's own (forked) trigger runner: memory, loop stalls, "
                         "reactions", ["--sensors", "50", "--steady", "3", "--alone", "3"]),
    "triggerer_runner_frozen": ("the same with gc.freeze() in the supervisor before it forks the runner (what "
                                "Airflow's LocalExecutor and DAG processor do; the triggerer does not)",
                                ["--sensors", "50", "--steady", "3", "--alone", "3"]),
    "job_load": ("200 job sensors on 10 clusters and a 100k-line job log: ours vs per-job polling",
                 ["--jobs", "20", "--clusters", "2", "--window", "4", "--lines", "10000", "--log-seconds", "3"]),
    "dag_parse": ("parse time of each example DAG vs a bare airflow.sdk DAG of the same shape", ["--runs", "1"]),
    "data_feeding": ("rows/s of sharded JAX batches on 4 emulated devices: iter_batches vs Ray's iter_jax_batches "
                     "and hand loops doing the same work; data wait with a train step",
                     ["--sizes", "8x64K,128x4K", "--rounds", "1", "--runs", "1", "--epoch-mib", "8"]),
    "demo_wall_time": ("`make demo` end to end, wall time per task", []),
    "base_install": ("`pip install airflow-provider-raytpu` (base) into a fresh venv: time, size, Ray or not, "
                     "vs the release with ray[default] in the base dependencies", ["--rounds", "1"]),
    "preprocess_pass": ("the preprocessing job's workload vs the same Ray Data pipeline written by hand, JSONL from "
                        "GCS over TLS: rows/s and input bytes read / input size",
                        ["--rows", "20000", "--rounds", "1"]),
}


# Benchmarks that are another script run with fixed arguments.
SCRIPTS: dict[str, tuple[str, list[str]]] = {"triggerer_runner_frozen": ("triggerer_runner", ["--freeze-before-fork"])}


def run(name: str, extra: list[str], repeat: int = 1) -> dict[str, Any]:
    """Run one benchmark ``repeat`` times; with repeats, its result file holds the medians (see :func:`merge`)."""
    script_name, fixed = SCRIPTS.get(name, (name, []))
    script = _common.BENCH_DIR / f"{script_name}.py"
    extra = [*fixed, *extra]
    path = _common.RESULTS / f"{name}.json"
    started = time.time()
    returncode, kept = 0, []
    for k in range(repeat):
        print(f"\n=== {name} ({k + 1}/{repeat}): "
              f"{' '.join(['.venv/bin/python', f'benchmarks/{script_name}.py', *extra])}",
              flush=True)
        t0 = time.time()
        proc = subprocess.run([_common.PYTHON, str(script), *extra], cwd=str(_common.REPO))
        returncode = returncode or proc.returncode
        if path.exists() and path.stat().st_mtime >= t0:
            copy = _common.RESULTS / f"{name}.run{k + 1}.json"
            copy.write_text(path.read_text())
            kept.append(copy)
    if repeat > 1 and kept:
        merge(path, kept)
    took = time.time() - started
    fresh = path.exists() and path.stat().st_mtime >= started
    return {"name": name, "returncode": returncode, "seconds": took, "fresh_result": fresh}


def _median(values: list[Any]) -> Any:
    import statistics

    numbers = [v for v in values if isinstance(v, (int, float)) and v == v]
    return statistics.median(numbers) if numbers else None


def merge(path: Any, runs: list[Any]) -> None:
    """One result from repeated runs: every summary figure and goal value is the median of the runs
    (each run's own figures stay in ``runs``, and in ``<name>.run<k>.json``)."""
    datas = [json.loads(p.read_text()) for p in runs]
    merged = dict(datas[0])
    merged["repeats"] = len(datas)
    merged["runs_started_at"] = [d.get("started_at") for d in datas]
    merged["runs_load_average"] = [(d.get("machine") or {}).get("load_average") for d in datas]
    merged["duration_seconds"] = sum(d.get("duration_seconds") or 0 for d in datas)
    rows = []
    for i, row in enumerate(datas[0].get("summary", [])):
        same = [d["summary"][i] for d in datas if len(d.get("summary", [])) > i
                and d["summary"][i]["metric"] == row["metric"]]
        ours, base = _median([r["ours"] for r in same]), _median([r["baseline"] for r in same])
        rows.append({**row, "ours": ours, "baseline": base, "ratio": _common.ratio(ours, base),
                     "how": f"{row['how']}; median of {len(same)} runs",
                     "runs": [[r["ours"], r["baseline"]] for r in same]})
    merged["summary"] = rows
    goals = []
    for i, goal in enumerate(datas[0].get("goals", [])):
        same = [d["goals"][i] for d in datas if len(d.get("goals", [])) > i and d["goals"][i]["goal"] == goal["goal"]]
        checks = []
        for j, (what, _, limit, unit) in enumerate(goal["checks"]):
            checks.append([what, _median([g["checks"][j][1] for g in same]), limit, unit])
        goals.append({**goal, "checks": checks, "how": f"{goal['how']}; median of {len(same)} runs",
                      "runs": [[c[1] for c in g["checks"]] for g in same]})
    merged["goals"] = goals
    path.write_text(json.dumps(merged, indent=2) + "\n")


def load(name: str) -> dict[str, Any] | None:
    path = _common.RESULTS / f"{name}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def md_escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def kept_from_doc() -> dict[str, dict[str, list[str]]]:
    """Per benchmark, its table rows, command note and findings in the current docs/benchmarks.md: result
    files are not committed, so a benchmark without one here keeps the figures the doc has."""
    kept: dict[str, dict[str, list[str]]] = {name: {"rows": [], "notes": [], "findings": []} for name in BENCHMARKS}
    if not DOC.exists():
        return kept
    for line in DOC.read_text().splitlines():
        for name in BENCHMARKS:
            if line.startswith(f"| {name} | "):
                kept[name]["rows"].append(line)
            elif line.startswith(f"- **{name}** "):
                kept[name]["notes"].append(line.replace("; this run, ", "; an earlier run, "))
            elif line.startswith((f"- {name} ", f"- {name}, ", f"- {name}:")):
                kept[name]["findings"].append(line)
    return kept


def write_doc(machine: dict[str, Any], command: str, ran: list[dict[str, Any]], started: float) -> None:
    outcome = {r["name"]: r for r in ran}
    kept = kept_from_doc()
    kept_findings: list[str] = []
    load_avg = machine["load_average"]
    lines = [
        "# Benchmarks",
        "",
        "Latest figures, written by `benchmarks/run_all.py`. What each benchmark measures and how: "
        "[`benchmarks/README.md`](../benchmarks/README.md); every figure with its raw samples is in "
        "`benchmarks/results/<name>.json` after a run. Speed is measured here, never asserted in tests.",
        "",
        f"- Command: `{command}`{' (`make bench`)' if command.endswith('run_all.py') else ''}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(started))}"
        + ("; it ran nothing: the figures are the latest result files', each with its own command, time and "
           "load below" if not ran else ""),
        f"- Machine: {machine['cores']} cores, {machine.get('memory_gib', '?')} GiB memory, "
        f"Python {machine['python']}, {machine['platform']}",
        f"- Load average at start: {load_avg[0]} / {load_avg[1]} / {load_avg[2]} (1 / 5 / 15 min); the machine is "
        "shared with other engineers' test runs, so absolute times move with the load: the ratios, measured side "
        "by side in one run, are the figures to compare.",
        "- *how*: `measured` = both sides measured in the same run; `derived` = computed from measured figures "
        "(the benchmark's JSON says how).",
        "",
        "| benchmark | metric | ours | baseline | ours/baseline | unit | how |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes: list[str] = []
    for name, (what, _) in BENCHMARKS.items():
        data = load(name)
        ran_now = outcome.get(name)
        if data is None:
            if kept[name]["rows"]:
                lines += kept[name]["rows"]
                notes += kept[name]["notes"]
                kept_findings += kept[name]["findings"]
                continue
            status = "failed" if ran_now else "not run"
            lines.append(f"| {name} | *{status}: no result* | | | | | |")
            continue
        if ran_now and not ran_now["fresh_result"]:
            lines.append(f"| {name} | *failed in this run (exit {ran_now['returncode']}); figures below are from "
                         f"{data.get('started_at')}* | | | | | |")
        if data.get("skipped"):
            lines.append(f"| {name} | *skipped: {md_escape(data.get('reason', ''))}* | | | | | |")
        elif data.get("error") and not data.get("summary"):
            lines.append(f"| {name} | *error: {md_escape(data['error'])}* | | | | | |")
        for row in data.get("summary", []):
            baseline = _common.fmt(row["baseline"])
            if row.get("baseline_name"):
                baseline = f"{baseline} ({md_escape(row['baseline_name'])})" if row["baseline"] is not None else "-"
            lines.append(
                f"| {name} | {md_escape(row['metric'])} | {_common.fmt(row['ours'])} | {baseline} | "
                f"{_common.fmt_ratio(row['ratio'])} | {row['unit']} | {row['how']} |"
            )
        m = data.get("machine", {})
        when = "this run" if ran_now and ran_now["fresh_result"] else f"an earlier run ({data.get('started_at')})"
        took = f", took {data['duration_seconds']:.0f} s" if data.get("duration_seconds") is not None else ""
        loads = data.get("runs_load_average")
        load_text = (f"{data['repeats']} runs, medians reported; 1-min load average at their starts "
                     + ", ".join(str((la or ['?'])[0]) for la in loads)) if loads else \
            f"load average at its start {(m.get('load_average') or ['?'])[0]}"
        notes.append(f"- **{name}** — {what}. `{data.get('command')}`; {when}{took}; {load_text}.")
    lines += ["", *_goals(), "## Commands and load per benchmark", "", *notes, ""]
    findings = _findings() + kept_findings
    if findings:
        lines += ["## Notes from the figures", "", *findings, ""]
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n".join(lines))


def _goals() -> list[str]:
    """The goal table (goal / measured / met / command) from every result file that states goals."""
    rows = []
    for name in BENCHMARKS:
        data = load(name) or {}
        for goal in data.get("goals", []):
            if "checks" not in goal:  # a result file older than the goal table
                continue
            text, met = _common.goal_text(goal)
            verdict = {True: "met", False: "**not met**", None: "-"}[met]
            runs = goal.get("runs")
            if runs:
                text += "; runs: " + ", ".join("/".join(_common.fmt(v) for v in r) for r in runs)
            rows.append(f"| {md_escape(goal['goal'])} | {md_escape(text)} | {verdict} | {md_escape(goal['how'])} | "
                        f"`{data.get('command')}` |")
    if not rows:
        return []
    return ["## Goals", "", "| goal | measured | | how | command |", "| --- | --- | --- | --- | --- |", *rows, ""]


def _findings() -> list[str]:
    """A few plain-language lines read off the result files (only what the numbers say)."""
    out = []
    cap = load("triggerer_capacity") or {}
    for r in cap.get("runs", []):
        if r.get("variant") != "watch" or "error" in r:
            continue
        lag = r["restart_lag"]
        out.append(f"- triggerer_capacity, {r['triggers']} sensors over {r['transport'].upper()}: "
                   f"{r['rss_mib']:.0f} MiB in all, of which {r['floor_rss_mib']:.0f} MiB is the floor "
                   f"(interpreter, Airflow, Kubernetes clients) and {r['rss_per_sensor_kib']:.0f} KiB per sensor; all "
                   f"watching {r['all_watching_s']:.2f} s after they started at once; the loop's longest stall then "
                   f"{lag.get('max_ms', 0):.0f} ms, of which the longest garbage collection "
                   f"{lag.get('gc_max_ms', 0):.0f} "
                   f"ms ({lag.get('gc_full_collections', 0)} full collection(s) of the whole heap); "
                   f"{r['connections_opened_to_establish']} connection(s) opened to the API server.")
    return out + _feeding_findings()


def _feeding_findings() -> list[str]:
    """data_feeding against its goals: >= 1.3x Ray's iter_jax_batches, >= 1x the same-work hand loop, wait <= 5 %."""
    rows = (load("data_feeding") or {}).get("summary", [])

    def ratios(baseline: str) -> dict[str, float]:
        return {r["metric"].split(":")[0]: r["ratio"] for r in rows
                if r["unit"] == "rows/s" and r["baseline_name"] == baseline and r["ratio"] is not None}

    vs_ray, vs_hand = ratios("Ray's iter_jax_batches"), ratios("hand loop, make_array per column")
    waits = {r["metric"].split(":")[0]: r["ours"] for r in rows if "data wait" in r["metric"]}
    if not vs_ray:
        return []

    def misses(figures: dict[str, float], goal: float, above: bool = True) -> str:
        missed = [f"{size} ({value:.3g})" for size, value in figures.items()
                  if (value < goal if above else value > goal)]
        return "met at every size" if not missed else "missed at " + "; ".join(missed)

    return [f"- data_feeding goals: >= 1.3x Ray's iter_jax_batches rows/s {misses(vs_ray, 1.3)}; >= 1.0x the "
            f"same-work hand loop {misses(vs_hand, 1.0)}; data wait <= 5 % of the epoch with the train step "
            f"{misses(waits, 5.0, above=False)} (on this 2-core host the step and the feeding share the cores: "
            "see `feeding vs the train step`)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the scripts work, figures are rough")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each benchmark; the figures are their medians")
    parser.add_argument("--doc-only", action="store_true",
                        help="run nothing: write docs/benchmarks.md from the latest result files")
    args = parser.parse_args()
    only = [n for n in args.only.split(",") if n]
    skip = {n for n in args.skip.split(",") if n}
    unknown = [n for n in [*only, *skip] if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {', '.join(BENCHMARKS)}")
    names = [n for n in (only or BENCHMARKS) if n not in skip]
    machine = _common.machine_info()
    command = _common.command_line()
    started = time.time()
    print(f"{len(names)} benchmarks on {machine['cores']} cores, load average {machine['load_average']}", flush=True)
    ran = [] if args.doc_only else [run(n, BENCHMARKS[n][1] if args.quick else [], args.repeat) for n in names]
    write_doc(machine, command, ran, started)
    print(f"\nwrote {DOC.relative_to(_common.REPO)}")
    _common.print_table(["benchmark", "exit", "seconds", "result"],
                        [[r["name"], r["returncode"], f"{r['seconds']:.0f}", "fresh" if r["fresh_result"] else "none"]
                         for r in ran])
    if any(r["returncode"] != 0 for r in ran):
        sys.exit(1)


if __name__ == "__main__":
    main()
