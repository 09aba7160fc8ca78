"""Run DAGs for real with ``dag.test()``, and play the scheduler when a test kills a worker.

DAG files live in the test Airflow home's dags folder, as in a deployment.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from datetime import UTC, datetime
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
    """A task's state, try, return value, links (as the API server answers them) and other XComs (by key; of an
    unmapped task) after a run."""

    state: str
    try_number: int
    result: Any
    links: dict[str, str | None] = field(default_factory=dict)
    ti_id: str = ""
    xcoms: dict[str, Any] = field(default_factory=dict)


# How Airflow's serde tags what JSON cannot hold (a tuple, a datetime, ...): a plain XCom has none.
SERDE_TAGS = ("__classname__", "__type", "__var", "__data__")


def not_plain(value: Any, where: str = "") -> list[str]:
    """Where an XCom value, as stored, is not plain JSON (lists, dicts, strings, numbers, booleans, null)."""
    if isinstance(value, dict):
        found = [f"{where} has serde tag {key!r}" for key in value if key in SERDE_TAGS]
        for key, item in value.items():
            found += not_plain(item, f"{where}.{key}")
        return found
    if isinstance(value, list):
        return [problem for i, item in enumerate(value) for problem in not_plain(item, f"{where}[{i}]")]
    if value is None or isinstance(value, (str, int, float, bool)):
        return []
    return [f"{where} is a {type(value).__name__}"]


def run_xcoms(run: Any) -> dict[tuple[str, str], Any]:
    """Every XCom of the run as stored, by (task id, key): return values and link values."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(XComModel.task_id, XComModel.key, XComModel.value).where(
                XComModel.dag_id == run.dag_id, XComModel.run_id == run.run_id
            )
        ).all()
    return {(task, key): _stored(value) for task, key, value in rows}


def _stored(value: Any) -> Any:
    """An XCom column value: Airflow stores the serialised JSON text (a link's URL may be a bare string)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def task_links(run: Any, task_id: str, map_index: int = -1) -> dict[str, str | None]:
    """A task's links as the API server answers ``GET .../taskInstances/{task_id}/links`` (its own route function)."""
    from airflow.api_fastapi.core_api.routes.public.extra_links import get_extra_links
    from airflow.models.dagbag import DBDagBag
    from airflow.utils.session import create_session
    from fastapi import HTTPException

    with create_session() as session:
        try:
            answer = get_extra_links(run.dag_id, run.run_id, task_id, session, DBDagBag(), map_index=map_index)
        except HTTPException as exc:
            # A task added to the DAG after this run was created is not in the run's DAG version:
            # the API server answers 404 for its links (the UI shows none).
            if exc.status_code == 404 and f"Task with ID = {task_id} not found" in str(exc.detail):
                return {}
            raise
    return dict(answer.extra_links)


def write_dag(airflow_home: Path, source: str, dag_id: str) -> Path:
    path = airflow_home / "dags" / f"{dag_id}.py"
    path.write_text(textwrap.dedent(source))
    return path


def load_dag(path: Path, dag_id: str) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


def task_instances(outcome: dict[str, TaskOutcome]) -> dict[str, str]:
    """Task instance id -> task id, to find each task's log in ``dag.test()``'s output (``tests.support.task_logs``)."""
    return {o.ti_id: task for task, o in outcome.items()}


def outcomes(run: Any) -> dict[str, TaskOutcome]:
    """Each task's outcome, by task id (``task_id[i]`` for map index i of a mapped task); fails when any
    XCom of the run (every task's return value and links, in every test that runs a DAG) is not plain JSON."""
    stored = run_xcoms(run)
    tagged = [problem for (task, key), value in stored.items() for problem in not_plain(value, f"{task}:{key}")]
    assert not tagged, f"XComs that are not plain JSON: {tagged}"
    found = {}
    for ti in run.get_task_instances():
        mapped = ti.map_index is not None and ti.map_index >= 0
        result = ti.xcom_pull(task_ids=ti.task_id, map_indexes=ti.map_index) if mapped else ti.xcom_pull(
            task_ids=ti.task_id)
        found[f"{ti.task_id}[{ti.map_index}]" if mapped else ti.task_id] = TaskOutcome(
            str(ti.state), ti.try_number, result, task_links(run, ti.task_id, ti.map_index), str(ti.id),
            {} if mapped else {key: value for (task, key), value in stored.items()
                               if task == ti.task_id and key != "return_value" and not key.startswith("_link_")})
    return found


class _ParsedPerTry(dict):
    """A DAG's ``task_dict`` that hands ``dag.test()`` an operator parsed anew from the DAG file for
    every try and every poke, as a worker process does (nothing an operator keeps in memory
    survives to its next poke in reschedule mode, or to its retry)."""

    def __init__(self, path: Path, dag_id: str, tasks: dict[str, Any]) -> None:
        super().__init__(tasks)
        self.path, self.dag_id = path, dag_id

    def __getitem__(self, task_id: str) -> Any:
        return load_dag(self.path, self.dag_id).task_dict[task_id]


def run_dag(airflow_home: Path, source: str, dag_id: str, conf: dict[str, Any] | None = None,
            logical_date: datetime | None = None, fresh_operators: bool = False) -> dict[str, TaskOutcome]:
    """Write ``source`` as a DAG file, run it with ``dag.test(run_conf=conf)``; outcome per task id.

    :param logical_date: the run's logical date (default: now); two DAGs run for the same one get
        the same run id (``manual__<date>``), as scheduled runs of one date do (``scheduled__<date>``).
    :param fresh_operators: run every try and poke on an operator parsed anew, as a deployment does.
    """
    ensure_airflow_db()
    path = write_dag(airflow_home, source, dag_id)
    dag = load_dag(path, dag_id)
    if fresh_operators:
        dag.task_dict = _ParsedPerTry(path, dag_id, dag.task_dict)
    if logical_date is None:
        return outcomes(dag.test(run_conf=conf or {}))
    return outcomes(dag.test(run_conf=conf or {}, logical_date=logical_date, run_after=logical_date))


def lose_worker(dag_id: str, task_id: str) -> str:
    """What the scheduler does when a running task's worker stops heartbeating: fail the try,
    so it goes up for retry if it has retries left. Returns the run id."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
        ).one()
        assert str(ti.state) == "running", f"expected the killed try to be running, not {ti.state}"
        ti.state = "up_for_retry" if ti.try_number <= ti.max_tries else "failed"
        ti.end_date = datetime.now(UTC)
        return ti.run_id


def clear_task(dag_id: str, task_id: str) -> str:
    """What a user's Clear of one task does (Airflow's own ``clear_task_instances``: the task starts a
    new cycle of tries); returns the run id. Carry the run on with :func:`resume_dag_run`."""
    from airflow.models.taskinstance import TaskInstance, clear_task_instances
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
        ).one()
        clear_task_instances([ti], session)
        return ti.run_id


def rendered_fields(dag_id: str, task_id: str) -> dict[str, Any]:
    """The task's rendered template fields as the UI shows them (the latest try's)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(select(RenderedTaskInstanceFields).where(
            RenderedTaskInstanceFields.dag_id == dag_id, RenderedTaskInstanceFields.task_id == task_id)).one()
        return dict(row.rendered_fields)


def resume_dag_run(dag_path: Path, dag_id: str, run_id: str) -> dict[str, TaskOutcome]:
    """Carry an existing run on to its end, scheduling retries the way ``dag.test()`` does,
    but without the Clear that ``dag.test()`` starts with (a Clear is not a retry)."""
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    dag = load_dag(dag_path, dag_id)
    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).one()
        run.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        if run.state == DagRunState.QUEUED:  # a Clear of a finished run queues it; the scheduler starts it
            run.state = DagRunState.RUNNING
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
    # python -m tests.support.airflow_runner <dag file> <dag id>: run a DAG in a process a test can kill.
    load_dag(Path(sys.argv[1]), sys.argv[2]).test()
