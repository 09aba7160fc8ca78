"""RayJobTrigger across a triggerer restart: the position in the job's log is kept in the task's XCom, saved
before lines are written and confirmed after, so the next trigger writes each line once, and lines a killed
triggerer may not have written again, marked."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_raytpu.loop_shared import close_loop_shared
from airflow_provider_raytpu.triggers import ray_job
from airflow_provider_raytpu.triggers.ray_job import LOG_OFFSET_KEY
from tests.fakeapi.test_job_trigger import (  # noqa: F401 (jobs: a fixture)
    WRITTEN,
    first_event,
    jobs,
    lines,
    trigger,
    written,
)
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.jobs_stub import JobsStub

pytestmark = pytest.mark.timeout(120)
AGAIN = re.compile(r"\[ray job, again\] (.*?) *\[airflow_provider_raytpu\.triggers\.ray_job\.RayJobTrigger\]")


async def resume_to_the_end(jobs: JobsStub, kube: FakeKubeApiServer, task_instance: SimpleNamespace,
                            chars: int) -> dict[str, Any]:
    """A new trigger of job-1 for the task (as a restarted triggerer makes it), run until it has written
    ``chars`` characters of the log; then the job ends: its event."""
    resumed = trigger("a", "job-1")
    resumed.task_instance = task_instance
    task = asyncio.create_task(first_event(resumed))
    await asyncio.to_thread(kube.wait_for, lambda: resumed.logged_chars == chars, 10)
    jobs.finish("a", "job-1")
    return await task


@pytest.fixture
def task_instance(airflow_home: Path, request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """A task instance of a DAG of the test's own in the test database, and Airflow's in-process
    supervisor comms for its XComs (what the triggerer's supervisor does for a trigger's XCom requests)."""
    import psutil
    import structlog
    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.execution_time.supervisor import (
        InProcessSupervisorComms,
        InProcessTestSupervisor,
        set_supervisor_comms,
    )
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from tests.support.airflow_runner import run_dag

    dag_id = f"job_log_{request.node.name[len('test_'):][:60]}"
    run_dag(airflow_home, f"""
from datetime import datetime
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator
with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    EmptyOperator(task_id="job")
""", dag_id)
    with create_session() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).one()
        found = SimpleNamespace(id=ti.id, dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id, map_index=-1,
                                try_number=ti.try_number)
    supervisor = InProcessTestSupervisor(id=found.id, pid=os.getpid(), process=psutil.Process(),
                                         process_log=structlog.get_logger(logger_name="task").bind(),
                                         client=InProcessTestSupervisor._api_client())
    supervisor.comms = InProcessSupervisorComms(supervisor=supervisor)
    with set_supervisor_comms(supervisor.comms):
        yield found


async def test_a_restarted_trigger_goes_on_after_the_lines_already_written(
        jobs: JobsStub, kube: FakeKubeApiServer, task_instance: SimpleNamespace,
        capfd: pytest.CaptureFixture[str]) -> None:
    from airflow.sdk.execution_time.xcom import XCom

    jobs.add("a", "job-1", log=lines(0, 12) + "half")
    first = trigger("a", "job-1")
    first.task_instance = task_instance  # as the triggerer sets it
    task = asyncio.create_task(first_event(first))
    await asyncio.to_thread(kube.wait_for, lambda: first.logged_chars == len(lines(0, 12)), 10)
    task.cancel()  # the triggerer stops
    with pytest.raises(asyncio.CancelledError):
        await task
    await close_loop_shared()
    saved = XCom.get_one(key=LOG_OFFSET_KEY, dag_id=task_instance.dag_id, task_id="job",
                         run_id=task_instance.run_id, map_index=-1)
    assert saved == {"submission_id": "job-1", "logged_chars": len(lines(0, 12)), "confirmed_chars": len(lines(0, 12))}

    jobs.append("a", "job-1", " line\n" + lines(12, 20))
    assert trigger("a", "job-1").logged_chars == 0  # the new triggerer makes it from the kwargs stored at defer time
    event = await resume_to_the_end(jobs, kube, task_instance, len(lines(0, 12) + "half line\n" + lines(12, 20)))
    assert event["status"] == "SUCCEEDED"
    assert "result" not in event, "the result may have been in the part of the log the first trigger read"
    assert written(capfd) == [f"line {i}" for i in range(12)] + ["half line"] + [f"line {i}" for i in range(12, 20)]


async def test_lines_held_until_the_next_save_are_written_once_by_the_next_trigger(
        jobs: JobsStub, kube: FakeKubeApiServer, task_instance: SimpleNamespace,
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The position is saved before the lines up to it are written: a triggerer that stops while lines
    wait for the next save has written none of them, and the next trigger writes them."""
    from airflow.sdk.execution_time.xcom import XCom

    monkeypatch.setattr(ray_job, "OFFSET_SAVE_SECONDS", 3600.0)
    jobs.add("a", "job-1", log=lines(0, 5))
    first = trigger("a", "job-1")
    first.task_instance = task_instance
    task = asyncio.create_task(first_event(first))
    await asyncio.to_thread(kube.wait_for, lambda: first.logged_chars == len(lines(0, 5)), 10)  # the first save is due
    jobs.append("a", "job-1", lines(5, 9))
    await asyncio.to_thread(kube.wait_for, lambda: "line 8\n" in first._unwritten, 10)  # read, waiting for a save
    task.cancel()  # the triggerer stops
    with pytest.raises(asyncio.CancelledError):
        await task
    await close_loop_shared()
    assert written(capfd) == [f"line {i}" for i in range(5)]
    assert XCom.get_one(key=LOG_OFFSET_KEY, dag_id=task_instance.dag_id, task_id="job", run_id=task_instance.run_id,
                        map_index=-1) == {"submission_id": "job-1", "logged_chars": len(lines(0, 5)),
                                          "confirmed_chars": len(lines(0, 5))}

    assert (await resume_to_the_end(jobs, kube, task_instance, len(lines(0, 9))))["status"] == "SUCCEEDED"
    assert written(capfd) == [f"line {i}" for i in range(5, 9)]


async def test_lines_whose_save_fails_wait_for_a_later_save(
        jobs: JobsStub, kube: FakeKubeApiServer, task_instance: SimpleNamespace,
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping triggerer's saves fail (its connection to the supervisor is closing): lines whose
    position could not be saved are not written then, so the next trigger writes them once; after
    SAVE_FAILURES_BEFORE_WRITING failures in a row the log goes on regardless."""
    monkeypatch.setattr(ray_job, "OFFSET_SAVE_SECONDS", 0.5)
    jobs.add("a", "job-1", log=lines(0, 5))
    first = trigger("a", "job-1")
    first.task_instance = SimpleNamespace(**{**vars(task_instance), "run_id": "no-such-run"})
    task = asyncio.create_task(first_event(first))
    await asyncio.to_thread(kube.wait_for, lambda: first._failed_saves >= 1, 10)
    assert written(capfd) == []
    await asyncio.to_thread(kube.wait_for, lambda: first.logged_chars == len(lines(0, 5)), 10)
    assert first._failed_saves >= ray_job.SAVE_FAILURES_BEFORE_WRITING
    jobs.finish("a", "job-1")
    assert (await task)["status"] == "SUCCEEDED"
    assert written(capfd) == [f"line {i}" for i in range(5)]


async def test_lines_a_killed_triggerer_may_not_have_written_are_written_again_marked(
        jobs: JobsStub, kube: FakeKubeApiServer, task_instance: SimpleNamespace,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A triggerer killed after saving the position of lines 5-7 and before confirming them may have lost
    them with its supervisor (which reads them between its database rounds): the next trigger says so and
    writes them again, marked, then goes on unmarked; its own saves are confirmed."""
    from airflow.sdk.execution_time.xcom import XCom

    target = {"dag_id": task_instance.dag_id, "task_id": "job", "run_id": task_instance.run_id, "map_index": -1}
    XCom.set(LOG_OFFSET_KEY, {"submission_id": "job-1", "logged_chars": len(lines(0, 8)),
                              "confirmed_chars": len(lines(0, 5))}, **target)
    jobs.add("a", "job-1", log=lines(0, 11))
    assert (await resume_to_the_end(jobs, kube, task_instance, len(lines(0, 11))))["status"] == "SUCCEEDED"
    out = capfd.readouterr().out
    assert AGAIN.findall(out) == [f"line {i}" for i in range(5, 8)]
    assert WRITTEN.findall(out) == [f"line {i}" for i in range(8, 11)]
    assert "stopped while writing the 21 characters of its log after the first 35" in out
    assert XCom.get_one(key=LOG_OFFSET_KEY, **target) == {
        "submission_id": "job-1", "logged_chars": len(lines(0, 11)), "confirmed_chars": len(lines(0, 11))}

