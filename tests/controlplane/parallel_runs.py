"""Several runs of one DAG at the same time, as a scheduler with free worker slots runs them: each run in a
process of its own (``dag.test()`` for one logical date), all sharing the test session's Airflow database.
Each process starts once the one before it has made its DAG run: every ``dag.test()`` writes the DAG to the
database first, and two first writes at once collide (``UNIQUE constraint failed: dag.dag_id``).

``python -m tests.controlplane.parallel_runs <dag file> <dag id> <logical date>`` is one such process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tests.support.airflow_runner import TaskOutcome, ensure_airflow_db, load_dag, outcomes, write_dag

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ParallelRun:
    """One run: its logical date, its task outcomes and what its process printed (the tasks' logs)."""

    logical_date: datetime
    outcome: dict[str, TaskOutcome]
    log: str


def run_in_parallel(airflow_home: Path, source: str, dag_id: str, dates: list[datetime],
                    timeout: float = 600) -> list[ParallelRun]:
    """Run ``dag_id`` once per logical date, all at once; each run's outcome and log, in ``dates`` order."""
    ensure_airflow_db()
    path = write_dag(airflow_home, source, dag_id)
    from airflow.models import DagRun

    processes = []
    for date in dates:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.controlplane.parallel_runs", str(path), dag_id, date.isoformat()],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=os.environ.copy()))
        deadline = time.monotonic() + 120
        while not DagRun.find(dag_id=dag_id, logical_date=date) and processes[-1].poll() is None:
            assert time.monotonic() < deadline, f"no DAG run for {date} after 120 s"
            time.sleep(0.2)
    logs = [process.communicate(timeout=timeout)[0] for process in processes]
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log[-5000:]
    return [ParallelRun(d, outcomes(DagRun.find(dag_id=dag_id, logical_date=d)[0]), log)
            for d, log in zip(dates, logs, strict=True)]


if __name__ == "__main__":
    file, dag, date = sys.argv[1:]
    when = datetime.fromisoformat(date)
    load_dag(Path(file), dag).test(logical_date=when, run_after=when)
