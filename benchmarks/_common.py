"""Shared helpers for the benchmarks: a private Airflow home, the fake Kubernetes API, result files.

Every benchmark script imports this module first (``import _common``): it puts the repository
root on ``sys.path`` and points Airflow at a throw-away home BEFORE Airflow is imported, exactly
as ``tests/conftest.py`` does, so no benchmark touches a real Airflow installation.

A result file is ``benchmarks/results/<name>.json``::

    {"benchmark": name, "started_at": ..., "command": ..., "machine": {...}, "parameters": {...},
     "summary": [{"metric", "ours", "baseline", "baseline_name", "ratio", "unit", "how"}...],
     ...details...}

``summary`` rows are what ``run_all.py`` puts in ``docs/benchmarks.md``; ``how`` says whether a
figure was ``measured`` or ``derived`` (computed from measured figures, e.g. analytically).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "benchmarks"
RESULTS = BENCH_DIR / "results"
PYTHON = sys.executable
NAMESPACE = "bench"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_AIRFLOW_HOME: Path | None = None


def setup_airflow_env() -> Path:
    """A private Airflow home (SQLite), set in the environment before Airflow is imported.

    Child processes inherit it. Idempotent; removed at interpreter exit by the process that made it.
    """
    global _AIRFLOW_HOME
    if _AIRFLOW_HOME is not None:
        return _AIRFLOW_HOME
    if os.environ.get("RAYTPU_BENCH_AIRFLOW_HOME"):  # a parent benchmark made it
        _AIRFLOW_HOME = Path(os.environ["RAYTPU_BENCH_AIRFLOW_HOME"])
        return _AIRFLOW_HOME
    home = Path(tempfile.mkdtemp(prefix="raytpu-bench-airflow-"))
    (home / "dags").mkdir()
    os.environ.update(
        {
            "RAYTPU_BENCH_AIRFLOW_HOME": str(home),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__WORKERS__API_RETRY_WAIT_MIN": "0.05",
            "AIRFLOW__WORKERS__API_RETRY_WAIT_MAX": "0.5",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        }
    )
    import atexit

    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(home, ignore_errors=True))
    _AIRFLOW_HOME = home
    return home


def quiet_logs() -> None:
    """Keep the benchmark's table readable: warnings and above only."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    for name in ("airflow", "airflow_provider_raytpu", "tests.support.fake_apiserver", "aiohttp", "kubernetes_asyncio",
                 "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def raise_fd_limit(wanted: int = 16384) -> int:
    """Raise the soft open-files limit towards the hard one; returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(max(soft, wanted), hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- the raytpu connection pointed at a fake API server ---------------------------------------------

def raytpu_connection(kube_conn_id: str = "kube_test", namespace: str = NAMESPACE) -> str:
    return json.dumps({"conn_type": "raytpu", "extra": {"backend": "kubernetes", "kubernetes_conn_id": kube_conn_id,
                                                        "namespace": namespace}})


def point_connections_at(kube_airflow_connection: str, namespace: str = NAMESPACE) -> None:
    """``raytpu_default`` (backend kubernetes) -> ``kube_test`` (cncf-kubernetes) -> the fake server."""
    os.environ["AIRFLOW_CONN_KUBE_TEST"] = kube_airflow_connection
    os.environ["AIRFLOW_CONN_RAYTPU_DEFAULT"] = raytpu_connection(namespace=namespace)


@contextlib.contextmanager
def fake_kube(*, delay: float = 0.05, stagger: float = 0.0, mode: str = "hold",
              namespace: str = NAMESPACE) -> Iterator[tuple[Any, Any]]:
    """An in-process fake API server (its own thread) with the KubeRay reactor; connections point at it."""
    from tests.support.fake_apiserver.kuberay import KubeRayReactor
    from tests.support.fake_apiserver.server import FakeKubeApiServer

    with FakeKubeApiServer() as server:
        with KubeRayReactor(server, delay=delay, stagger=stagger, mode=mode) as reactor:
            point_connections_at(server.airflow_connection(namespace), namespace)
            yield server, reactor


def cluster_manifest(name: str, namespace: str = NAMESPACE, topology: str = "4x4", num_slices: int = 1) -> dict:
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    return build_ray_cluster(name=name, namespace=namespace, tpu=TpuSlice("v6e", topology, num_slices=num_slices))


def is_ready_commit(ev: Any) -> bool:
    """A change event that makes a RayCluster ready: state ready and every worker ready (the reactor's flip)."""
    if ev.plural != "rayclusters" or ev.type != "MODIFIED":
        return False
    st = ev.object.get("status") or {}
    old = (ev.old_object or {}).get("status") or {}

    def ready(s: dict) -> bool:
        return (s.get("state") == "ready" and s.get("desiredWorkerReplicas", 0) > 0
                and s.get("readyWorkerReplicas", 0) == s.get("desiredWorkerReplicas", 0))

    return ready(st) and not ready(old)


# -- statistics ------------------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(values: Sequence[float]) -> dict[str, float]:
    values = list(values)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def ratio(ours: float | None, baseline: float | None) -> float | None:
    if ours is None or baseline is None or baseline == 0 or math.isnan(ours) or math.isnan(baseline):
        return None
    return ours / baseline


# -- machine and results -----------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    load = os.getloadavg()
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover
        pass
    return info


def command_line() -> str:
    try:
        script = str(Path(sys.argv[0]).resolve().relative_to(REPO))
    except ValueError:
        script = sys.argv[0]
    return shlex.join([".venv/bin/python", script, *sys.argv[1:]])


class Result:
    """Collects one benchmark's figures and writes ``benchmarks/results/<name>.json``."""

    def __init__(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        self.name = name
        self.started = time.time()
        self.data: dict[str, Any] = {
            "benchmark": name,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "command": command_line(),
            "machine": machine_info(),
            "parameters": parameters or {},
            "summary": [],
        }

    def add(self, metric: str, ours: float | None, baseline: float | None, unit: str, *,
            baseline_name: str, how: str = "measured", lower_is_better: bool = True, note: str = "") -> None:
        """One row of the summary table. ``how``: "measured", "derived" or "measured/derived"."""
        row = {
            "metric": metric,
            "ours": ours,
            "baseline": baseline,
            "baseline_name": baseline_name,
            "ratio": ratio(ours, baseline),
            "unit": unit,
            "how": how,
            "lower_is_better": lower_is_better,
        }
        if note:
            row["note"] = note
        self.data["summary"].append(row)

    def goal(self, goal: str, checks: Sequence[tuple[str, float | None, float, str]], note: str = "",
             how: str = "measured") -> None:
        """One row of the goal table: each check is ``(what, value, limit, unit)``, met when value <= limit."""
        self.data.setdefault("goals", []).append(
            {"goal": goal, "checks": [list(c) for c in checks], "note": note, "how": how})

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def skip(self, reason: str) -> None:
        self.data["skipped"] = True
        self.data["reason"] = reason

    def write(self) -> Path:
        self.data["duration_seconds"] = round(time.time() - self.started, 1)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.name}.json"
        path.write_text(json.dumps(self.data, indent=2, default=_jsonable) + "\n")
        return path

    def finish(self) -> None:
        """Write the result file and print the table and the goals."""
        path = self.write()
        self.print_table()
        for goal in self.data.get("goals", []):
            text, met = goal_text(goal)
            print(f"  goal: {goal['goal']}: {text} -> {'met' if met else 'NOT met'}")
        print(f"  -> {path.relative_to(REPO)}")

    def print_table(self) -> None:
        print(f"\n{self.name}  ({self.data['machine']['cores']} cores, load "
              f"{self.data['machine']['load_average'][0]} at start)")
        if self.data.get("skipped"):
            print(f"  skipped: {self.data['reason']}")
            return
        rows = [[r["metric"], fmt(r["ours"]), f"{fmt(r['baseline'])} ({r['baseline_name']})" if r["baseline_name"]
                 else fmt(r["baseline"]), fmt_ratio(r["ratio"]), r["unit"], r["how"]]
                for r in self.data["summary"]]
        print_table(["metric", "ours", "baseline", "ours/baseline", "unit", "how"], rows)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.1:
            return f"{value:.2f}"
        if abs(value) >= 0.001:
            return f"{value:.4f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def fmt_ratio(value: float | None) -> str:
    """ours/baseline: ``0.42x``, ``3.1x``; far below 1 as a fraction, ``1/2,070``."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:,.0f}x"
    if value >= 0.1:
        return f"{value:.3g}x"
    inverse = 1 / value
    return f"1/{inverse:,.0f}" if inverse >= 100 else f"1/{inverse:.3g}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def goal_text(goal: dict[str, Any]) -> tuple[str, bool | None]:
    """What a goal row measured, and whether it is met."""
    parts, met = [], True
    for what, value, limit, unit in goal["checks"]:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{what}: -")
            met = None if met else met
            continue
        parts.append(f"{what} {fmt(float(value))}{(' ' + unit) if unit else ''}")
        if met is not None:
            met = met and float(value) <= limit
    text = ", ".join(parts) + (f" ({goal['note']})" if goal.get("note") else "")
    return text, met
