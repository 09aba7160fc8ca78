"""Run a DAG for real with ``dag.test()``: the DAG file lives in the test Airflow home's dags folder."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_db_ready = False


def ensure_airflow_db() -> None:
    """Create the SQLite metadata database once per test session."""
    global _db_ready
    if not _db_ready:
        from airflow.utils import db

        db.initdb()
        _db_ready = True


@dataclass
class TaskOutcome:
    state: str
    try_number: int
    result: Any


def run_dag(airflow_home: Path, source: str, dag_id: str, conf: dict[str, Any] | None = None) -> dict[str, TaskOutcome]:
    """Write ``source`` as a DAG file, run it with ``dag.test(run_conf=conf)``; outcome per task id."""
    ensure_airflow_db()
    path = airflow_home / "dags" / f"{dag_id}.py"
    path.write_text(textwrap.dedent(source))
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags[dag_id]
    run = dag.test(run_conf=conf or {})
    return {
        ti.task_id: TaskOutcome(str(ti.state), ti.try_number, ti.xcom_pull(task_ids=ti.task_id))
        for ti in run.get_task_instances()
    }
