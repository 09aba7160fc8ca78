"""Demo wall time: ``make demo`` end to end, and the wall time of each task of its DAG run.

``make demo`` (example_dags/demo/run.py) runs the ``nightly_finetune`` example DAG on the local
backend with ``airflow dags test`` and writes ``benchmarks/results/demo.json``
(``{"tasks": {task_id: seconds}, "total_seconds": ..., "wall_seconds": ...}``). This benchmark runs it,
times the whole command, and records the per-task seconds from that file (only when the file was
written by this run). Side by side: the tasks' summed time vs the DAG run's wall time (the rest is
Airflow's own scheduling between tasks in ``dags test``), and the DAG run vs the whole command
(fake GCS, database migration, clean-up).

By default the Makefile's ``install`` prerequisite is not remade (``make -o install demo``), so a
pip run does not land in the figure; ``--with-install`` runs plain ``make demo``. When the Makefile
has no ``demo`` target, the benchmark says so and exits 0 (skipped).

Run: ``.venv/bin/python benchmarks/demo_wall_time.py [--with-install] [--timeout 1800]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time

import _common

DEMO_JSON = _common.RESULTS / "demo.json"
LOG = _common.RESULTS / "demo_wall_time.log"


def has_demo_target() -> tuple[bool, str]:
    if shutil.which("make") is None:
        return False, "`make` is not installed"
    if not (_common.REPO / "Makefile").exists():
        return False, "there is no Makefile"
    probe = subprocess.run(["make", "-n", "-o", "install", "demo"], cwd=str(_common.REPO), capture_output=True,
                           text=True)
    if probe.returncode != 0:
        if "No rule to make target" in probe.stderr:
            return False, "the Makefile has no `demo` target yet (`make demo` does not exist)"
        return False, f"`make -n demo` failed: {probe.stderr.strip()[-500:]}"
    return True, probe.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--with-install", action="store_true", help="also run the install prerequisite")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    command = ["make", "demo"] if args.with_install else ["make", "-o", "install", "demo"]
    result = _common.Result("demo_wall_time", {"command": " ".join(command), "timeout_s": args.timeout})
    ok, detail = has_demo_target()
    if not ok:
        result.skip(detail)
        result.write()
        result.print_table()
        return
    result["recipe"] = detail
    _common.RESULTS.mkdir(parents=True, exist_ok=True)
    started_wall = time.time()
    t0 = time.monotonic()
    with LOG.open("w") as log:
        try:
            done = subprocess.run(command, cwd=str(_common.REPO), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.monotonic() - t0
    result["command_wall_s"] = wall
    result["log"] = str(LOG.relative_to(_common.REPO))
    tail = "\n".join(LOG.read_text(errors="replace").splitlines()[-40:])
    if rc != 0:
        result["error"] = f"`{' '.join(command)}` " + ("timed out" if rc is None else f"exited {rc}")
        result["log_tail"] = tail
        result.write()
        print(f"{result['error']} after {wall:.0f} s; log tail:\n{tail}", file=sys.stderr)
        sys.exit(1)
    if not DEMO_JSON.exists() or DEMO_JSON.stat().st_mtime < started_wall:
        result["error"] = f"`make demo` succeeded but did not write {DEMO_JSON.relative_to(_common.REPO)}"
        result.write()
        print(result["error"], file=sys.stderr)
        sys.exit(1)
    demo = json.loads(DEMO_JSON.read_text())
    tasks = {k: v for k, v in (demo.get("tasks") or {}).items()}
    result["tasks_s"] = tasks
    result["dag_run_s"] = demo.get("total_seconds")
    result["demo_script_wall_s"] = demo.get("wall_seconds")
    for task, seconds in sorted(tasks.items(), key=lambda kv: -(kv[1] or 0)):
        result.add(f"task {task}", seconds, None, "s", baseline_name="")
    summed = sum(v for v in tasks.values() if v)
    run = demo.get("total_seconds")
    result.add("tasks' summed time vs the DAG run", summed, run, "s", baseline_name="`airflow dags test` wall")
    result.add("the DAG run vs the whole `make demo`", run, wall, "s", baseline_name="`make demo` wall")
    path = result.write()
    result.print_table()
    print(f"  -> {path.relative_to(_common.REPO)} (log: {LOG.relative_to(_common.REPO)})")


if __name__ == "__main__":
    main()
