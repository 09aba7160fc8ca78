"""What a user sees of a task: readable job log lines, progress while waiting, links, step times, plain XComs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from airflow_provider_raytpu.backends.apply import wait_until_gone
from airflow_provider_raytpu.dashboard.job_log import (
    JobLogFollower,
    closing_line,
    job_message,
    readable_lines,
    returned,
    shown_tail,
    strip_ansi,
)
from airflow_provider_raytpu.dashboard.transport import DirectTransport
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.operators.jax_trainer import describe_step_times
from airflow_provider_raytpu.progress import LogPace, progress, with_pace
from airflow_provider_raytpu.status.plain import plain
from airflow_provider_raytpu.tasks.links import (
    dashboard_url,
    serve_application_url,
    storage_console_url,
)
from airflow_provider_raytpu.workloads.steps import combine_step_times, percentile, profile_window
from tests.support.airflow_runner import not_plain
from tests.support.task_logs import problems, task_logs

COLOURED = "\x1b[36m(RayTrainWorker pid=812)\x1b[0m train_loop: step 5 loss 0.25 (checkpoint)"


# -- job log lines ---------------------------------------------------------------------------------

def test_job_lines_lose_colour_codes_and_progress_redraws() -> None:
    assert strip_ansi(COLOURED) == "(RayTrainWorker pid=812) train_loop: step 5 loss 0.25 (checkpoint)"
    bar = "Reading: 0%|     | 0/10\rReading: 50%|##   | 5/10\rReading: 100%|#####| 10/10\n"
    assert readable_lines(bar + "\n" + COLOURED + "\n") == [
        "Reading: 100%|#####| 10/10", "(RayTrainWorker pid=812) train_loop: step 5 loss 0.25 (checkpoint)"]


def test_a_known_harmless_ray_traceback_is_one_line_that_explains_it() -> None:
    cleaner = "\x1b[36m(PlacementGroupCleaner pid=7244)\x1b[0m "
    log = "".join(f"{cleaner}{text}\n" for text in (
        "Exception in thread PlacementGroupCleanerMonitor:", "Traceback (most recent call last):",
        '  File "placement_group_cleaner.py", line 80, in _monitor_loop', "    alive = is_actor_alive(",
        "            ^^^^^^^^^^^^^^^", "ray.exceptions.RpcError: Timed out while waiting for GCS to become available.",
    )) + "(RayTrainWorker pid=7312) train_loop: step 5 loss 0.25 (checkpoint)\n" + (
        f"{cleaner}Traceback (most recent call last):\n")
    follower = JobLogFollower()
    lines = follower.shown(log)
    assert len(lines) == 2 and lines[0].startswith("(PlacementGroupCleaner) Ray Train's placement-group cleaner")
    assert lines[1] == "(RayTrainWorker pid=7312) train_loop: step 5 loss 0.25 (checkpoint)"
    other = "(TrainController pid=7205) Traceback (most recent call last):\n"
    # Another actor's traceback: its header (tests/unit/test_job_errors.py).
    assert follower.shown(log + other)[1:] == [
        "(TrainController pid=7205) Traceback (most recent call last): (frames: in the Ray dashboard's job log)"]


def test_the_job_supervisors_entrypoint_line_shows_secret_json_by_its_keys() -> None:
    config = json.dumps({"seed": 11, "token": "s3cret"})
    log = f"Running entrypoint for job raytpu-1-try1: python -m train --config '{config}' --steps 3\n"
    assert JobLogFollower().shown(log) == [
        "Running entrypoint for job raytpu-1-try1: python -m train --config '<JSON with keys: seed, token>' --steps 3"]
    plain = "Running entrypoint for job raytpu-2-try1: python -c 'print(1)'\n"
    assert JobLogFollower().shown(plain) == [plain.strip()]


def test_the_closing_line_names_job_status_time_and_result() -> None:
    line = closing_line("raytpu-ab-try1", "SUCCEEDED", 63.24, returned({"rows_in": 600, "rows_out": 600}))
    assert line == 'Ray job raytpu-ab-try1 SUCCEEDED after 63.2 s; returned {"rows_in": 600, "rows_out": 600}'
    assert returned(None) == "returned nothing (no RAYTPU_RESULT line)"
    long = returned({"x": "y" * 1000})
    assert len(long) < 420 and long.endswith("...")


# -- progress --------------------------------------------------------------------------------------

def test_a_log_pace_is_due_on_change_or_after_its_interval() -> None:
    now = [0.0]
    beat = LogPace(every=8, clock=lambda: now[0])
    assert beat.due("1 of 2 hosts")
    now[0] = 5
    assert not beat.due("1 of 2 hosts")
    assert beat.due("2 of 2 hosts")
    now[0] = 13.1
    assert beat.due("2 of 2 hosts") and beat.elapsed == 13.1
    now[0] = 15
    beat.quiet()
    now[0] = 22
    assert not beat.due("2 of 2 hosts") and beat.seconds_left() == 1
    now[0] = 30
    assert beat.seconds_left() == 0


class RecordingLog:
    """A task logger that records lines and signals the first one containing ``want``."""

    def __init__(self, want: str) -> None:
        self.lines: list[str] = []
        self.want = want
        self.seen = threading.Event()

    def info(self, message: str, *args: Any) -> None:
        self.lines.append(message % args)
        if self.want in self.lines[-1]:
            self.seen.set()


def test_progress_speaks_while_a_call_blocks() -> None:
    log = RecordingLog("head down, 1 of 2 TPU hosts up")
    with progress(log, "Stopping RayCluster ml/train", lambda: "head down, 1 of 2 TPU hosts up", every=0.01):
        assert log.seen.wait(10)
    assert any(line.startswith("Stopping RayCluster ml/train: head down, 1 of 2 TPU hosts up (") for line in log.lines)
    assert all(line.startswith("Stopping RayCluster ml/train") for line in log.lines)
    failing = RecordingLog("state unknown (ZeroDivisionError")
    with progress(failing, "Waiting", lambda: str(1 / 0), every=0.01):
        assert failing.seen.wait(10)
    slow = RecordingLog("Waiting for the head (")
    release = threading.Event()
    with progress(slow, "Waiting for the head", lambda: "ready" if release.wait(10) else "", every=0.01):
        assert slow.seen.wait(10), "a line comes on time although its detail is still being read"
        release.set()


def test_a_teardown_ends_with_how_long_the_whole_deletion_took() -> None:
    """The delete call itself (a local cluster stopping its processes) counts, not only the wait after it."""
    log = RecordingLog("")
    wait_until_gone("RayCluster", "train", "ml", lambda name, namespace: None, 60, 0.01, log, lambda: [],
                    deleting_since=time.monotonic() - 17.2)
    assert log.lines == ["RayCluster ml/train and its pods are gone after 17 s"]


async def test_with_pace_wakes_a_quiet_watch_without_losing_its_next_item() -> None:
    release = asyncio.Event()

    async def watch() -> AsyncIterator[str]:
        yield "provisioning"
        await release.wait()
        yield "ready"

    seen: list[str | None] = []
    async for item in with_pace(watch(), LogPace(every=0.01)):
        seen.append(item)
        if item is None:
            release.set()
    assert seen[0] == "provisioning" and seen[-1] == "ready" and None in seen


# -- links -----------------------------------------------------------------------------------------

def test_links_point_at_pages_a_browser_opens() -> None:
    dashboard = DirectTransport("http://10.0.0.5:8265")
    assert dashboard_url(dashboard) == "http://10.0.0.5:8265/"
    assert dashboard_url(dashboard, "jobs/raytpu-1-try1") == "http://10.0.0.5:8265/#/jobs/raytpu-1-try1"
    assert serve_application_url(dashboard, [{"name": "chat app"}]) == \
        "http://10.0.0.5:8265/#/serve/applications/chat%20app"
    assert serve_application_url(dashboard, [{"name": "a"}, {"name": "b"}]) == "http://10.0.0.5:8265/#/serve"


def test_storage_links_exist_only_for_real_gcs() -> None:
    assert storage_console_url("gs://bucket/runs/nightly-3f/profile", {}) == \
        "https://console.cloud.google.com/storage/browser/bucket/runs/nightly-3f/profile"
    assert storage_console_url("gs://bucket/runs", {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443"}) is None
    assert storage_console_url("/tmp/runs", {}) is None


# -- step times and profiles -----------------------------------------------------------------------

def test_profile_window_is_checked_before_anything_runs() -> None:
    assert profile_window(None) is None
    assert profile_window([100, 105]) == (100, 105)
    for bad in ((5, 5), (-1, 3), "100-105", (1, 2, 3)):
        with pytest.raises(InvalidInputError, match=r"profile_steps=.*\(100, 105\) traces steps 100 to 104"):
            profile_window(bad)


def test_step_times_combine_to_the_slowest_worker_and_read_as_one_line() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0 and percentile([1.0] * 20 + [9.0], 0.95) == 1.0
    workers = [
        {"rank": 0, "steps": 30, "median_s": 0.010, "p95_s": 0.020, "data_wait_share": 0.10, "first_step_s": 2.5},
        {"rank": 1, "steps": 30, "median_s": 0.012, "p95_s": 0.018, "data_wait_share": 0.25, "first_step_s": 2.4},
    ]
    combined = combine_step_times(workers)
    assert combined == {"workers": 2, "steps": 30, "median_s": 0.012, "p95_s": 0.020, "data_wait_share": 0.25,
                        "first_step_s": 2.5}
    assert describe_step_times(combined) == (
        "median 12.0 ms, p95 20.0 ms over 30 steps on 2 workers, waiting for data 25% of step time; "
        "first step 2.50 s (with compilation)")
    assert combine_step_times([]) is None
    assert describe_step_times(None).startswith("not recorded: time the train loop's steps with")


# -- plain XComs -----------------------------------------------------------------------------------

def test_plain_turns_tuples_and_enums_into_json() -> None:
    from airflow_provider_raytpu.status import ApplicationState, DeploymentState, ServicePhase, ServiceStatus

    status = ServiceStatus(ServicePhase.RUNNING, "serving v2", applications=(
        ApplicationState("chat", "RUNNING", deployments=(DeploymentState("LLM", "HEALTHY"),)),))
    data = plain(status)
    assert data["phase"] == "RUNNING" and data["applications"][0]["deployments"] == [
        {"name": "LLM", "status": "HEALTHY", "message": ""}]
    assert json.loads(json.dumps(data)) == data and not_plain(data) == []
    assert not_plain({"a": {"__classname__": "builtins.tuple", "__data__": [1]}}) != []


# -- the log reader the heavy tests use ---------------------------------------------------------------

def _line(second: int, message: str, logger: str = "airflow.task.operators.airflow_provider_raytpu.x.Op") -> str:
    return f"2026-12-03T09:00:{second:02d}.000000Z [info     ] {message} [{logger}] loc=x.py:1"


def test_the_log_reader_finds_what_a_user_should_not_see() -> None:
    stdout = "\n".join([
        _line(0, "[DAG TEST] starting task_id=train map_index=-1", "airflow.sdk.definitions.dag"),
        _line(0, "::endgroup::", "task"),
        _line(1, "Submitted Ray job raytpu-1-try1"),
        _line(2, f"[ray job] {COLOURED}"),
        _line(3, "[ray job] (RayTrainWorker pid=813) train_loop: step 5 loss 0.25 (checkpoint)"),
        _line(15, "Ray job raytpu-1-try1 SUCCEEDED after 14.0 s; returned {}"),
        _line(15, "::group::Post Execute", "task"),
        _line(16, "[DAG TEST] end task task_id=train map_index=-1", "airflow.sdk.definitions.dag"),
    ])
    stderr = "2026-12-03 09:00:01,512\tINFO dashboard_sdk.py:371 -- Uploading package gcs://_ray_pkg_1.zip.\n"
    found = problems(stdout, stderr)
    assert set(found) == {"train", "stderr"}
    assert any("terminal escape codes" in p for p in found["train"])
    assert any(p.startswith("logged 2 times: train_loop: step 5") for p in found["train"])
    assert any(p.startswith("12.0 s of silence after") for p in found["train"])
    assert [log.task_id for log in task_logs(stdout)] == ["train"]
    clean = "\n".join([
        _line(0, "[DAG TEST] starting task_id=delete map_index=-1", "airflow.sdk.definitions.dag"),
        _line(1, "::endgroup::", "task"),
        _line(9, "Deleting RayCluster default/x: the RayCluster is being deleted (8 s)"),
        _line(12, "RayCluster default/x deleted"),
        _line(12, "::group::Post Execute", "task"),
        _line(13, "[DAG TEST] end task task_id=delete map_index=-1", "airflow.sdk.definitions.dag"),
    ])
    assert problems(clean, "") == {}
    silent_delete = clean.replace(_line(9, "Deleting RayCluster default/x: the RayCluster is being deleted (8 s)"), "")
    assert problems(silent_delete, "") == {"delete": ["11.0 s of silence after: ::endgroup::"]}


def test_the_log_reader_finds_each_task_by_its_task_instance_without_the_dag_test_markers() -> None:
    ids = {"01a23b65-5e48-728b-8be8-61ed797fb60f": "delete", "01a23b65-5e49-7d4a-87dd-b266a7815e21": "deploy"}
    api = "airflow.api_fastapi.execution_api.routes.task_instances"
    stdout = "\n".join([
        _line(0, "Task started", api) + " ti_id=01a23b65-5e48-728b-8be8-61ed797fb60f",
        _line(0, "::endgroup::", "task"),
        _line(1, "RayCluster default/x deleted"),
        _line(1, "::group::Post Execute", "task"),
        _line(2, "Task started", api) + " ti_id=01a23b65-5e49-7d4a-87dd-b266a7815e21",
        _line(2, "::endgroup::", "task"),
        _line(3, "RayService default/s created"),
        _line(3, "::group::Post Execute", "task"),
    ])
    logs = task_logs(stdout, ids)
    assert [log.task_id for log in logs] == ["delete", "deploy"]
    assert [line.message for line in logs[1].provider_lines()] == ["RayService default/s created"]
    assert problems(stdout, "", ids) == {}


def test_secret_arguments_show_their_keys_only_wherever_the_command_is_repeated() -> None:
    import shlex

    from airflow_provider_raytpu.dashboard.job_log import job_message, mask_secret_arguments

    secret = "hunter2-4a5b6c'quoted"
    command = shlex.join(["python", "-m", "w", "--config", json.dumps({"wandb_api_key": secret, "lr": 0.1}),
                          "--transform-kwargs", json.dumps({"token": secret}), "--datasets", "{}"])
    line = f"Running entrypoint for job raytpu-1-try1: {command}"
    masked = mask_secret_arguments(line)
    assert secret not in masked
    assert masked == ("Running entrypoint for job raytpu-1-try1: python -m w --config '<JSON with keys: wandb_api_key, "
                      "lr>' --transform-kwargs '<JSON with keys: token>' --datasets '{}'")
    assert mask_secret_arguments(masked) == masked, "idempotent: a masked tail masked again keeps its keys"
    assert mask_secret_arguments('--config "{\\"token\\": \\"x\\"}" --config=[1]') == (
        "--config '<JSON with keys: token>' --config='<JSON>'")
    # Ray's message for a failed job quotes the log's last lines: the task shows its own tail instead.
    message = ("Job entrypoint command failed with exit code 3, last available logs (truncated to 20,000 chars):\n"
               f"{line}\nboom\n")
    assert job_message(message) == "Job entrypoint command failed with exit code 3"
    assert job_message("Failed to set up runtime environment.\n--config '{\"a\": 1}'") == (
        "Failed to set up runtime environment.\n--config '<JSON with keys: a>'")
    assert JobLogFollower().shown(line + "\n") == [masked]


def test_secret_values_are_registered_with_airflows_masker() -> None:
    from airflow.sdk._shared.secrets_masker import redact

    from airflow_provider_raytpu.tasks.base import mask_secret_values

    mask_secret_values({"wandb_api_key": "sk-abcdef123456", "nested": {"db_password": "pw-987654321"}, "lr": 0.123456})
    assert redact("key sk-abcdef123456 and pw-987654321, lr 0.123456") == "key *** and ***, lr 0.123456"


def test_a_failed_jobs_tail_and_message_read_as_plain_text_with_secret_arguments_by_their_keys() -> None:
    log = ("\x1b[36m(TrainController pid=7846)\x1b[0m Running python -m train --config '{\"api_key\": \"k-1\"}'\n"
           "loading 10%\rloading 100%\n\n"
           "ValueError: boom\x1b[32m [repeated 2x across cluster]\x1b[0m\n")
    assert shown_tail(log, 2) == "loading 100%\nValueError: boom [repeated 2x across cluster]"
    assert shown_tail(log, 3).splitlines()[0] == (
        "(TrainController pid=7846) Running python -m train --config '<JSON with keys: api_key>'")
    assert job_message("Job failed: \x1b[31mboom\x1b[0m, last available logs (truncated to 20,000 chars):\nx") == (
        "Job failed: boom")


def test_the_deploy_log_says_where_each_application_answers_and_how_to_call_it() -> None:
    from airflow_provider_raytpu.tasks.promotion import endpoint_line

    line = endpoint_line("http://127.0.0.1:8000/", [{"name": "llm", "route_prefix": "/v1"}, {"name": "tiny"}])
    assert line.startswith("Serve endpoint: llm at http://127.0.0.1:8000/v1, tiny at http://127.0.0.1:8000/. Send "
                           "each application what it takes (e.g. a POST with a JSON body); a browser's GET of it is "
                           "not a call")
