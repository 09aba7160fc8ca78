"""Run DAGs for real with ``dag.test()``, and play the scheduler when a test kills a worker.

DAG files live in the test Airflow home's dags folder, as in a deployment.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from datetime import datetime, timezone
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


def write_dag(airflow_home: Path, source: str, dag_id: str) -> Path:
    path = airflow_home / "dags" / f"{dag_id}.py"
    path.write_text(textwrap.dedent(source))
    return path


def load_dag(path: Path, dag_id: str) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


def outcomes(run: Any) -> dict[str, TaskOutcome]:
    return {
        ti.task_id: TaskOutcome(str(ti.state), ti.try_number, ti.xcom_pull(task_ids=ti.task_id))
        for ti in run.get_task_instances()
    }


def run_dag(airflow_home: Path, source: str, dag_id: str, conf: dict[str, Any] | None = None) -> dict[str, TaskOutcome]:
    """Write ``source`` as a DAG file, run it with ``dag.test(run_conf=conf)``; outcome per task id."""
    ensure_airflow_db()
    dag = load_dag(write_dag(airflow_home, source, dag_id), dag_id)
    return outcomes(dag.test(run_conf=conf or {}))


def lose_worker(dag_id: str, task_id: str) -> str:
    """What the scheduler does when a running task's worker stops heartbeating: fail the try,
    so it goes up for retry if it has retries left. Returns the run id."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
        ).one()
        assert str(ti.state) == "running", f"expected the killed try to be running, not {ti.state}"
        ti.state = "up_for_retry" if ti.try_number <= ti.max_tries else "failed"
        ti.end_date = datetime.now(timezone.utc)
        return ti.run_id


def resume_dag_run(dag_path: Path, dag_id: str, run_id: str) -> dict[str, TaskOutcome]:
    """Carry an existing run on to its end, scheduling retries the way ``dag.test()`` does,
    but without the Clear that ``dag.test()`` starts with (a Clear is not a retry)."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState

    dag = load_dag(dag_path, dag_id)
    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).one()
        run.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        while run.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = run.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            for ti in [t for t in run.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
        return outcomes(run)


if __name__ == "__main__":
    # python -m tests.airflow_runner <dag file> <dag id>: run a DAG in a process a test can kill.
    load_dag(Path(sys.argv[1]), sys.argv[2]).test()
