"""RayJobTrigger through the API server's service proxy: one status request per cluster per tick, the log
streamed once, each line written once across a cut stream and a triggerer restart."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_raytpu.backends.loop_shared import close_loop_shared
from airflow_provider_raytpu.triggers import ray_job
from airflow_provider_raytpu.triggers.ray_job import LOG_OFFSET_KEY, RayJobTrigger
from tests.fakekube.server import FakeKubeApiServer
from tests.kube.conftest import NAMESPACE
from tests.kube.jobs_stub import JobsStub

pytestmark = pytest.mark.timeout(120)

WRITTEN = re.compile(r"\[ray job\] (.*?) *\[airflow_provider_raytpu\.triggers\.ray_job\.RayJobTrigger\]")


@pytest.fixture
def jobs(kube: FakeKubeApiServer, connections: None) -> Iterator[JobsStub]:
    """A Jobs API for clusters ``a`` and ``b``, each behind its ``<name>-head-svc:dashboard``."""
    with JobsStub() as stub:
        for cluster in ("a", "b"):
            kube.create_object({"apiVersion": "v1", "kind": "Service",
                                "metadata": {"name": f"{cluster}-head-svc", "namespace": NAMESPACE},
                                "spec": {"ports": [{"name": "dashboard", "port": 8265}]}})
            kube.register_service_proxy(NAMESPACE, f"{cluster}-head-svc", "dashboard", stub.url_for(cluster))
        yield stub


def trigger(cluster: str, submission_id: str, **kwargs: Any) -> RayJobTrigger:
    return RayJobTrigger(submission_id, cluster, NAMESPACE, "raytpu_default", **{"poll_interval": 0.1, **kwargs})


async def first_event(t: RayJobTrigger) -> dict[str, Any]:
    async for event in t.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def written(capfd: pytest.CaptureFixture[str]) -> list[str]:
    """The job's lines the trigger wrote to the task log (Airflow's structlog output)."""
    return WRITTEN.findall(capfd.readouterr().out)


def lines(start: int, stop: int) -> str:
    return "".join(f"line {i}\n" for i in range(start, stop))


async def test_each_line_once_and_the_result_in_the_event(jobs: JobsStub, kube: FakeKubeApiServer,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    jobs.add("a", "job-1", log=lines(0, 25) + "half a li")
    task = asyncio.create_task(first_event(trigger("a", "job-1")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.append("a", "job-1", "ne\n" + lines(25, 40))
    jobs.finish("a", "job-1", text='RAYTPU_RESULT {"rows": 3}\nno newline at the end')
    event = await task
    assert event["status"] == "SUCCEEDED" and event["result"] == {"rows": 3}
    expected = [f"line {i}" for i in range(25)] + ["half a line"] + [f"line {i}" for i in range(25, 40)] + [
        'RAYTPU_RESULT {"rows": 3}', "no newline at the end"]
    assert written(capfd) == expected
    assert event["logged_chars"] == len("\n".join(expected))
    assert "log_tail" not in event, "Airflow logs the whole event: a success's tail would repeat lines in the log"
    assert jobs.requests[("a", "logs")] == 0, "the log streams; it is not downloaded"
    assert jobs.requests[("a", "tail")] == 1


async def test_one_status_request_per_cluster_per_tick(jobs: JobsStub, kube: FakeKubeApiServer) -> None:
    ids = {cluster: [f"{cluster}-{i}" for i in range(6)] for cluster in ("a", "b")}
    for cluster, names in ids.items():
        for name in names:
            jobs.add(cluster, name, log=f"{name} started\n")
    tasks = [asyncio.create_task(first_event(trigger(c, n, poll_interval=0.3))) for c, ns in ids.items() for n in ns]
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 12, 10)
    await asyncio.sleep(1.5)
    for cluster in ids:
        jobs.requests[(cluster, "list")] = 0
    await asyncio.sleep(1.5)  # five ticks
    per_cluster = {cluster: jobs.requests[(cluster, "list")] for cluster in ids}
    for cluster, names in ids.items():
        for name in names:
            jobs.finish(cluster, name)
    events = await asyncio.gather(*tasks)
    assert {e["status"] for e in events} == {"SUCCEEDED"}
    assert all(3 <= n <= 7 for n in per_cluster.values()), per_cluster  # ~5 ticks, not 6 jobs x 5 ticks
    assert sum(jobs.requests[(c, "get")] for c in ids) == 0


async def test_a_cut_stream_resumes_without_writing_a_line_twice(jobs: JobsStub, kube: FakeKubeApiServer,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    jobs.add("a", "job-1", log=lines(0, 10))
    follower = trigger("a", "job-1")
    task = asyncio.create_task(first_event(follower))
    await asyncio.to_thread(kube.wait_for, lambda: follower.logged_chars == len(lines(0, 10)), 10)
    assert jobs.cut_tails() == 1
    jobs.append("a", "job-1", lines(10, 20))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "tail")] == 2 and jobs.open_tails == 1, 10)
    jobs.finish("a", "job-1", text=lines(20, 30))
    assert (await task)["status"] == "SUCCEEDED"
    assert written(capfd) == [f"line {i}" for i in range(30)]


async def test_refused_upgrades_fall_back_to_reading_the_whole_log(jobs: JobsStub, kube: FakeKubeApiServer,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    kube.proxy.refuse_upgrades = True
    jobs.add("a", "job-1", log=lines(0, 5))
    task = asyncio.create_task(first_event(trigger("a", "job-1")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "logs")] >= 1, 10)
    jobs.append("a", "job-1", "a half")
    await asyncio.sleep(0.3)
    jobs.finish("a", "job-1", "FAILED", "exit code 3", text=" line\n" + lines(5, 8))
    event = await task
    assert (event["status"], event["message"]) == ("FAILED", "exit code 3")
    assert event["log_tail"].splitlines() == [f"line {i}" for i in range(5)] + ["a half line"] + [
        f"line {i}" for i in range(5, 8)], "the task's error shows a failed job's last lines"
    assert written(capfd) == [f"line {i}" for i in range(5)] + ["a half line"] + [f"line {i}" for i in range(5, 8)]
    assert jobs.requests[("a", "tail")] == 0


async def test_an_unknown_job_is_an_error_event(jobs: JobsStub) -> None:
    event = await first_event(trigger("a", "no-such-job", poll_interval=0.01))
    assert event["status"] == "ERROR" and "does not list job no-such-job" in event["message"]


# -- a triggerer restart: the position in the log is kept in the task's XCom -------------------------


@pytest.fixture
def task_instance(airflow_home: Path, request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """A task instance of a DAG of the test's own in the test database, and Airflow's in-process
    supervisor comms for its XComs (what the triggerer's supervisor does for a trigger's XCom requests)."""
    import psutil
    import structlog
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.execution_time.supervisor import (
        InProcessSupervisorComms,
        InProcessTestSupervisor,
        set_supervisor_comms,
    )
    from airflow.utils.session import create_session
    from tests.airflow_runner import run_dag

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
    assert saved == {"submission_id": "job-1", "logged_chars": len(lines(0, 12))}

    jobs.append("a", "job-1", " line\n" + lines(12, 20))
    second = trigger("a", "job-1")  # the new triggerer makes it from the kwargs stored at defer time
    assert second.logged_chars == 0
    second.task_instance = task_instance
    task = asyncio.create_task(first_event(second))
    await asyncio.to_thread(kube.wait_for, lambda: second.logged_chars == len(lines(0, 12) + "half line\n" + lines(12, 20)), 10)
    jobs.finish("a", "job-1")
    event = await task
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
                        map_index=-1) == {"submission_id": "job-1", "logged_chars": len(lines(0, 5))}

    second = trigger("a", "job-1")
    second.task_instance = task_instance
    task = asyncio.create_task(first_event(second))
    await asyncio.to_thread(kube.wait_for, lambda: second.logged_chars == len(lines(0, 9)), 10)
    jobs.finish("a", "job-1")
    assert (await task)["status"] == "SUCCEEDED"
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
