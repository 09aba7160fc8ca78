"""RayJobTrigger through the API server's service proxy: one status request per cluster per tick, the log
streamed once, each line written once across a cut stream (across a triggerer restart: test_job_log_restart)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.jobs_stub import JobsStub
from tests.support.kube_connection import NAMESPACE
from tests.support.task_logs import waited_seconds

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


async def test_more_open_log_tails_than_the_clients_pool_holds_do_not_starve_the_status_reads(
        jobs: JobsStub, kube: FakeKubeApiServer) -> None:
    followed = 110  # kubernetes_asyncio's pool holds 100 connections (connection_pool_maxsize)
    for i in range(followed):
        jobs.add("a", f"job-{i}", log="started\n")
    tasks = [asyncio.create_task(first_event(trigger("a", f"job-{i}", poll_interval=0.2))) for i in range(followed)]
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == followed, 30)
    listed = jobs.requests[("a", "list")]
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "list")] >= listed + 3, 10)
    for i in range(followed):
        jobs.finish("a", f"job-{i}")
    assert {event["status"] for event in await asyncio.wait_for(asyncio.gather(*tasks), 60)} == {"SUCCEEDED"}


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


async def test_a_stream_dropped_just_before_the_job_ends_still_delivers_the_end_of_the_log(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    # Seen in the deployment tier under load: the API server restarted (every connection dropped), and the
    # job ended before the follower's next status read; the last 18 of its 40 lines never reached the task log.
    jobs.add("a", "job-1", log=lines(0, 10))
    follower = trigger("a", "job-1", poll_interval=1.0)
    task = asyncio.create_task(first_event(follower))
    await asyncio.to_thread(kube.wait_for, lambda: follower.logged_chars == len(lines(0, 10)), 10)
    assert kube.drop_connections() >= 1
    jobs.finish("a", "job-1", text=lines(10, 20))  # within the second before the next status read
    assert (await task)["status"] == "SUCCEEDED"
    assert written(capfd) == [f"line {i}" for i in range(20)]
    assert jobs.requests[("a", "tail")] == 2, "the rest came from the stream opened again"


async def test_the_status_read_at_the_end_stands_while_the_log_drains(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    # Seen under load in the 100-cluster test: the read after the job's end failed while its log drained, and
    # the trigger took the status from the emptied view: "'NoneType' object is not subscriptable".
    jobs.add("a", "job-1", log=lines(0, 5))
    jobs.tail_lag = 2.0
    task = asyncio.create_task(first_event(trigger("a", "job-1")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.finish("a", "job-1", text=lines(5, 8))
    reads = jobs.requests[("a", "list")]
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "list")] > reads, 10)
    jobs.forget("a", "job-1")  # the next reads, while the tail stays open, no longer list it
    event = await task
    assert event["status"] == "SUCCEEDED", event
    assert written(capfd) == [f"line {i}" for i in range(8)]
    assert jobs.requests[("a", "list")] > reads + 1, "the drain outlasted a read that missed the job"


async def test_a_status_read_sent_before_rays_close_does_not_open_the_stream_again(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    # Seen under CI's load: a read of the job list sent while the job still ran answered "running" only after Ray
    # had closed the drained log's stream, and the tail took it for a close before the job's end.
    jobs.add("a", "job-1", log=lines(0, 5))
    task = asyncio.create_task(first_event(trigger("a", "job-1")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.list_lag = 1.0
    reads = jobs.requests[("a", "list")]
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "list")] > reads, 10)
    jobs.finish("a", "job-1", text=lines(5, 8))  # the read in flight lists the job running
    event = await task
    assert event["status"] == "SUCCEEDED", event
    assert written(capfd) == [f"line {i}" for i in range(8)]
    assert jobs.requests[("a", "tail")] == 1, "a stale 'running' opened Ray's closed stream again"


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
    """A reachable dashboard without the job (a restarted head forgets its jobs): an error within a minute at
    most, here the whole (shorter) grace."""
    event = await first_event(trigger("a", "no-such-job", poll_interval=0.01, unreachable_grace_period=1))
    assert event["status"] == "ERROR"
    assert waited_seconds(event["message"], "the dashboard of RayCluster ml/a without the job for {s} s, longer than "
                          "its grace of 1 s: GET /api/jobs/ does not list no-such-job") >= 1


SECRET = "sk-live-0f9e8d7c6b5a"


async def test_a_job_that_fails_early_keeps_its_secret_config_out_of_the_event(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    """Within 50 lines the job's tail holds Ray's own first line, which repeats the command and its --config."""
    import json
    import shlex

    command = shlex.join(["python", "-m", "airflow_provider_raytpu.workloads.train", "--config",
                          json.dumps({"wandb_api_key": SECRET, "lr": 0.1}), "--datasets", "{}"])
    first = f"Running entrypoint for job job-1: {command}\n"
    jobs.add("a", "job-1", log=first + "loading\nstep 1\n")
    task = asyncio.create_task(first_event(trigger("a", "job-1")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    tail = first + "loading\nstep 1\nValueError: boom\n"
    jobs.finish("a", "job-1", status="FAILED", text="ValueError: boom\n", message=(
        "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n" + tail))
    event = await task
    assert event["status"] == "FAILED"
    assert SECRET not in json.dumps(event), event
    assert event["message"] == "Job entrypoint command failed with exit code 1"
    assert event["log_tail"].splitlines()[0] == (
        "Running entrypoint for job job-1: python -m airflow_provider_raytpu.workloads.train --config "
        "'<JSON with keys: wandb_api_key, lr>' --datasets '{}'")
    assert SECRET not in capfd.readouterr().out


async def test_the_tasks_secrets_are_masked_in_the_triggerer_that_follows_its_job(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    """A triggerer knows only the trigger's arguments: the secrets the task registered come with them (sealed with
    Airflow's Fernet key: Airflow stores the arguments as given), and the job's lines it writes, its event's
    message and log tail (stored and logged outside the triggerer) show them as ***."""
    import json

    secret = "env-" + "7f3a9c2e1d5b"  # a value of the task's env_vars / config; never registered in this process
    jobs.add("a", "job-2", log=f"connecting with {secret}\n")
    from airflow_provider_raytpu.triggers.ray_job import seal_secrets

    followed = trigger("a", "job-2", sealed_secrets=seal_secrets([secret]))
    assert secret not in repr(followed) and "sealed_secrets=<sealed>" in repr(followed)
    task = asyncio.create_task(first_event(followed))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.finish("a", "job-2", status="FAILED", text=f"ValueError: bad key {secret}\n",
                message=f"Job entrypoint command failed with exit code 1: bad key {secret}")
    event = await task
    assert secret not in json.dumps(event), event
    assert event["message"] == "Job entrypoint command failed with exit code 1: bad key ***"
    assert event["log_tail"].splitlines() == ["connecting with ***", "ValueError: bad key ***"]
    out = capfd.readouterr().out
    assert secret not in out and "[ray job] connecting with ***" in out


async def test_a_job_that_ended_with_a_traceback_sends_its_exception_and_place_not_its_tail(
        jobs: JobsStub, kube: FakeKubeApiServer) -> None:
    """Airflow logs the whole event: the traceback, already in the task log once, is not sent again; its
    exception (masked) and innermost frame are what the task's error starts with."""
    from airflow_provider_raytpu.triggers.ray_job import seal_secrets

    secret = "env-" + "c0ffee5eed42"
    jobs.add("a", "job-4", log="step 0\n")
    task = asyncio.create_task(first_event(trigger("a", "job-4", sealed_secrets=seal_secrets([secret]))))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.finish("a", "job-4", status="FAILED", message="Job entrypoint command failed with exit code 1",
                text=('Traceback (most recent call last):\n  File "/app/job.py", line 3, in <module>\n    main()\n'
                      f"ValueError: bad key {secret}\n"))
    event = await task
    assert event["error"] == {"exception": "ValueError: bad key ***", "where": "/app/job.py, line 3, in <module>"}
    assert "log_tail" not in event


async def test_a_failed_jobs_event_carries_no_terminal_escape_codes(jobs: JobsStub, kube: FakeKubeApiServer) -> None:
    """Ray colours its workers' prefixes and dedup notes; the task's error (the event's message and tail) is read
    in a browser, where they show as raw escape characters."""
    jobs.add("a", "job-3", log="\x1b[36m(TrainController pid=7846)\x1b[0m step 0\n")
    task = asyncio.create_task(first_event(trigger("a", "job-3")))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.finish("a", "job-3", status="FAILED", text="ValueError: boom\x1b[32m [repeated 2x across cluster]\x1b[0m\n",
                message="Job entrypoint command failed: \x1b[31mValueError: boom\x1b[0m")
    event = await task
    assert "\x1b" not in event["message"] + event["log_tail"], event
    assert event["log_tail"].splitlines() == ["(TrainController pid=7846) step 0",
                                              "ValueError: boom [repeated 2x across cluster]"]
    assert event["message"] == "Job entrypoint command failed: ValueError: boom"


async def test_a_dashboard_unreachable_for_longer_than_the_grace_ends_the_wait(
        jobs: JobsStub, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    jobs.add("a", "job-1", log=lines(0, 3))
    kube.inject(None, r"/services/a-head-svc:dashboard/proxy/", 503, times=None)
    event = await first_event(trigger("a", "job-1", unreachable_grace_period=3))
    assert event["status"] == "ERROR"
    assert re.fullmatch(r"Ray job job-1: the dashboard of RayCluster ml/a unreachable for [34] s, longer than its "
                        r"grace of 3 s: GET /api/jobs/ on the dashboard of RayCluster ml/a answered 503: .*",
                        event["message"], re.DOTALL), event["message"]
    out = capfd.readouterr().out
    assert "Ray job job-1: the dashboard of RayCluster ml/a unreachable for 0 s (GET /api/jobs/" in out
    assert "trying for up to 3 s more" in out


@pytest.mark.parametrize(("try_number", "retried"), [(1, True), (3, False)])
def test_a_task_that_gives_up_stops_its_job_only_on_its_last_try(
        jobs: JobsStub, try_number: int, retried: bool) -> None:
    from airflow.sdk.exceptions import AirflowException

    from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator

    jobs.add("a", "job-1", log=lines(0, 3))
    task = SubmitRayJobOperator(task_id="job", cluster_name="a", entrypoint="python job.py", retries=2)
    ti = SimpleNamespace(dag_id="d", run_id="r", task_id="job", map_index=-1, try_number=try_number, max_tries=2)
    given_up = {"status": "ERROR", "submission_id": "job-1",
                "message": "Ray job job-1: the dashboard of RayCluster ml/a unreachable for 601 s"}
    with pytest.raises(AirflowException, match="Gave up following Ray job job-1") as raised:
        task.execute_complete({"ti": ti}, given_up)
    assert ("it was not stopped: the next try reattaches to it" in str(raised.value)) is retried
    assert jobs.requests[("a", "stop")] == (0 if retried else 1)
    assert jobs.jobs["a"]["job-1"].status == ("RUNNING" if retried else "STOPPED")


def test_a_half_open_dashboard_does_not_hang_a_synchronous_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dashboard that accepts connections and never answers (a half-open connection): Ray's own client would
    wait for ever; every synchronous request here has a timeout, and the call gives up after its grace."""
    import socket
    import threading
    import time

    from airflow_provider_raytpu.dashboard import jobs as jobs_api
    from airflow_provider_raytpu.dashboard.jobs import JobsApi
    from airflow_provider_raytpu.dashboard.outage import DashboardUnreachableError, call_through_outage
    from airflow_provider_raytpu.dashboard.transport import DirectTransport

    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(50)], daemon=True).start()
    monkeypatch.setattr(jobs_api, "REQUEST_TIMEOUT_SECONDS", 0.5)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(DashboardUnreachableError, match=r"the dashboard unreachable for \d s, longer than its grace "
                                                        r"of 2 s: .*[Tt]imed? ?out"):
        call_through_outage(lambda: JobsApi(DirectTransport(url)).get_job_info("job-1"), "the dashboard", 2,
                            logging_to_nowhere())
    assert time.monotonic() - started < 10
    assert held, "the connections were accepted, never answered"
    silent.close()


def logging_to_nowhere() -> Any:
    import logging

    return logging.getLogger("tests.nowhere")


async def test_following_jobs_on_100_clusters_leaves_nothing_of_them_behind(
        kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch, record_property: Any) -> None:
    """A triggerer runs for weeks: the job board and the HTTP session of every cluster it followed go once the
    last job on it has ended (here the dashboards are reached at their URLs: one session per cluster)."""
    import gc

    import psutil

    from airflow_provider_raytpu.dashboard import transport
    from airflow_provider_raytpu.loop_shared import loop_shared
    from tests.support.kube_connection import raytpu_connection

    monkeypatch.setattr(transport, "SESSION_LINGER_SECONDS", 0.2)
    clusters = [f"c{i:03d}" for i in range(100)]
    rss: list[int] = []
    with JobsStub() as stub:
        monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection(NAMESPACE))
        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(
            dashboard="url", dashboard_url=f"http://127.0.0.1:{stub.port}/{{cluster_name}}", ray_auth=False))
        for job in ("job-1", "job-2"):  # two rounds: the second shows whether anything accumulates
            for cluster in clusters:
                stub.add(cluster, job, log=lines(0, 3))
            gc.collect()
            rss.append(psutil.Process().memory_info().rss)
            tasks = [asyncio.create_task(first_event(trigger(cluster, job))) for cluster in clusters]
            await asyncio.to_thread(kube.wait_for, lambda: stub.open_tails == 100, 30)
            shared = loop_shared()
            sessions = [shared.peek(key) for key in shared.keys() if key[0] == "http-session"]
            boards = [key for key in shared.keys() if key[0] == "job-board"]
            assert (len(sessions), len(boards)) == (100, 100), "one session and one board per cluster while followed"
            for cluster in clusters:
                stub.finish(cluster, job, text="done\n")
            events = await asyncio.gather(*tasks)
            assert {e["status"] for e in events} == {"SUCCEEDED"}, [e for e in events if e["status"] != "SUCCEEDED"][:3]
            await asyncio.sleep(0.5)  # past the sessions' linger
            left = [key for key in shared.keys() if key[0] in ("http-session", "job-board")]
            assert left == [], f"kept for clusters no longer followed: {left[:5]}"
            assert all(session.closed for session in sessions)
            assert not shared._locks.keys() & {("job-board", "raytpu_default", NAMESPACE, c) for c in clusters}
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)
        record_property("rss_mib_before_first_second_after", [round(r / 2**20, 1) for r in rss])
