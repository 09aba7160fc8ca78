"""DAG parse time: each example DAG file vs a bare ``airflow.sdk`` DAG of the same shape.

For every ``example_dags/*.py`` present at run time, in a fresh interpreter each run (so nothing the
file imports is cached, as in the DAG processor's per-file child process):

1. Airflow core is imported first (``airflow.sdk`` and ``DagBag``: what the DAG processor has loaded
   before it parses a file), then the file is parsed with ``DagBag(dag_folder=file)``; the time of
   that call is the parse time. The wall time of the whole interpreter (start to exit) is recorded too.
2. The bare twin: a generated file with the same DAGs (same DAG ids + ``_bare``, same task ids, same
   dependencies), every task an ``EmptyOperator``, parsed the same way.

Runs alternate ours / bare; the median of ``--runs`` is reported, ratio ours/bare. Each run also
lists the modules the parse imported, and flags the heavy ones DESIGN.md keeps out of DAG parsing
(ray, jax, orbax, kubernetes, google).

Run: ``.venv/bin/python benchmarks/dag_parse.py [--runs 3] [files...]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

_common.setup_airflow_env()

EXAMPLES = _common.REPO / "example_dags"
HEAVY = ("ray", "jax", "jaxlib", "orbax", "flax", "optax", "kubernetes", "kubernetes_asyncio", "google", "torch",
         "tensorflow", "vllm")

# Runs in the fresh interpreter: preload Airflow core, then time DagBag on one file.
PARSE = r"""
import json, sys, time
t0 = time.perf_counter()
import airflow.sdk
from airflow.dag_processing.dagbag import DagBag
t1 = time.perf_counter()
before = set(sys.modules)
t2 = time.perf_counter()
bag = (DagBag(dag_folder=sys.argv[1], include_examples=False)
       if "include_examples" in DagBag.__init__.__code__.co_varnames else DagBag(dag_folder=sys.argv[1]))
t3 = time.perf_counter()
new = sorted(set(sys.modules) - before)
shape = None
if len(sys.argv) > 2:
    shape = {d.dag_id: {"tasks": [t.task_id for t in d.tasks],
                        "edges": [[u, t.task_id] for t in d.tasks for u in sorted(t.upstream_task_ids)]}
             for d in bag.dags.values()}
print("RAYTPU_PARSE " + json.dumps({"airflow_import_s": t1 - t0, "parse_s": t3 - t2, "dags": sorted(bag.dag_ids),
      "errors": {str(k): str(v)[-2000:] for k, v in bag.import_errors.items()}, "new_modules": new, "shape": shape}))
"""


def parse_once(path: Path, want_shape: bool = False) -> dict[str, Any]:
    env = dict(os.environ)
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(EXAMPLES)  # as deployed: the examples' helper packages import
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), env.get("PYTHONPATH", "")) if p)
    argv = [_common.PYTHON, "-c", PARSE, str(path)] + (["shape"] if want_shape else [])
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(_common.REPO), timeout=600)
    wall = time.perf_counter() - t0
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RAYTPU_PARSE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"parsing {path.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("RAYTPU_PARSE "):])
    out["interpreter_wall_s"] = wall
    return out


def bare_twin(shape: dict[str, Any]) -> str:
    """A DAG file of the same shape with EmptyOperators only."""
    lines = [
        "from datetime import datetime",
        "from airflow.sdk import DAG",
        "from airflow.providers.standard.operators.empty import EmptyOperator",
        "",
    ]
    for dag_id, d in shape.items():
        lines += [
            f"with DAG({dag_id + '_bare'!r}, schedule=None, start_date=datetime(2026, 1, 1), catchup=False):",
            f"    t = {{tid: EmptyOperator(task_id=tid) for tid in {d['tasks']!r}}}",
            f"    for up, down in {d['edges']!r}:",
            "        t[up] >> t[down]",
            "",
        ]
    return "\n".join(lines)


def heavy_modules(modules: list[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules if m.split(".")[0] in HEAVY})


def top_packages(modules: list[str], n: int = 8) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in modules:
        top = m.split(".")[0]
        counts[top] = counts.get(top, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh-interpreter parses per file and variant")
    parser.add_argument("files", nargs="*", help="DAG files (default: every example_dags/*.py)")
    args = parser.parse_args()
    files = [Path(f).resolve() for f in args.files] or sorted(p for p in EXAMPLES.glob("*.py")
                                                              if p.name != "__init__.py")
    result = _common.Result("dag_parse", {
        "runs": args.runs, "files": [str(f.relative_to(_common.REPO)) for f in files],
        "method": "fresh interpreter per run; airflow.sdk + DagBag imported first; time of DagBag(dag_folder=file)",
    })
    per_file: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="raytpu-bare-dags-") as tmp:
        for path in files:
            name = path.name
            print(f"  parsing {name} ...", flush=True)
            try:
                first = parse_once(path, want_shape=True)
                if first["errors"]:
                    raise RuntimeError(f"import errors: {first['errors']}")
                bare = Path(tmp) / f"bare_{name}"
                bare.write_text(bare_twin(first["shape"]))
                ours_runs, bare_runs = [], []
                for _ in range(args.runs):
                    ours_runs.append(parse_once(path))
                    b = parse_once(bare)
                    if b["errors"]:
                        raise RuntimeError(f"bare twin import errors: {b['errors']}")
                    bare_runs.append(b)
            except Exception as exc:
                per_file[name] = {"error": str(exc)}
                print(f"    failed: {str(exc)[:500]}", flush=True)
                continue
            med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
            tasks = sum(len(d["tasks"]) for d in first["shape"].values())
            entry = {
                "dags": first["dags"],
                "tasks": tasks,
                "parse_s": {"ours_median": med(ours_runs, "parse_s"), "bare_median": med(bare_runs, "parse_s"),
                            "ours_all": [r["parse_s"] for r in ours_runs],
                            "bare_all": [r["parse_s"] for r in bare_runs]},
                "interpreter_wall_s": {"ours_median": med(ours_runs, "interpreter_wall_s"),
                                       "bare_median": med(bare_runs, "interpreter_wall_s")},
                "airflow_core_import_s_median": med(ours_runs + bare_runs, "airflow_import_s"),
                "modules_imported_by_parse": {"ours": len(ours_runs[0]["new_modules"]),
                                              "bare": len(bare_runs[0]["new_modules"])},
                "top_packages_imported_by_parse": top_packages(ours_runs[0]["new_modules"]),
                "heavy_modules_imported": heavy_modules(ours_runs[0]["new_modules"]),
            }
            per_file[name] = entry
            p = entry["parse_s"]
            result.add(f"{name}: parse ({len(first['dags'])} DAGs, {tasks} tasks)", p["ours_median"], p["bare_median"],
                       "s", baseline_name="bare airflow.sdk DAG, same shape")
            w = entry["interpreter_wall_s"]
            result.add(f"{name}: fresh interpreter, start to exit", w["ours_median"], w["bare_median"], "s",
                       baseline_name="bare airflow.sdk DAG, same shape")
            rows.append([name, len(first["dags"]), tasks, _common.fmt(p["ours_median"]), _common.fmt(p["bare_median"]),
                         _common.fmt_ratio(_common.ratio(p["ours_median"], p["bare_median"])),
                         entry["modules_imported_by_parse"]["ours"], entry["modules_imported_by_parse"]["bare"],
                         ",".join(entry["heavy_modules_imported"]) or "none"])
    result["files"] = per_file
    path = result.write()
    print()
    _common.print_table(["file", "DAGs", "tasks", "parse s", "bare s", "ours/bare", "modules", "bare modules",
                         "heavy imports"], rows)
    result.print_table()
    print(f"  -> {path.relative_to(_common.REPO)}")
    if any("error" in v for v in per_file.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
