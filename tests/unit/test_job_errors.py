"""A failed job reads as cleanly as a successful one: each Ray actor's traceback as its header and exception line,
the driver's own traceback once at the log's end, and the task's error naming that exception and where it was
raised. The log below is a real one: Ray 2.60's JaxTrainer on an emulated v6e 2x4 slice whose train loop raised
at step 0 (``learning_rate: "fast"``), paths shortened."""

from __future__ import annotations

import pytest

from airflow_provider_raytpu.dashboard.job_log import JobError, JobLogFollower, job_error
from airflow_provider_raytpu.workloads.failures import as_written, describe_failure, user_traceback

PKG = "/tmp/ray/session_2026-12-06_16-03-19_934435_24451/runtime_resources/py_modules_files"
OURS = (f'  File "{PKG}/_ray_pkg_affea37908d536a5/airflow_provider_raytpu/workloads/train.py", line 169, '
        "in run_user_loop")
LOOP = f'  File "{PKG}/_ray_pkg_a145936bb24da232/pipeline/train_loop.py", line {{line}}, in {{function}}'
TRACEBACK = [
    "Traceback (most recent call last):",
    OURS,
    "    return load_object(import_path)(config)",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    LOOP.format(line=177, function="train_loop_per_worker"),
    "    train(config)",
    LOOP.format(line=101, function="train"),
    '    optimizer = make_optimizer(float(config["learning_rate"]))',
    "                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "ValueError: could not convert string to float: 'fast'",
]
WORKER = "(RayTrainWorker pid=25447)"
CONTROLLER = "(TrainController pid=25315)"
REPEATED = " [repeated 3x across cluster]"
# The first line Ray deduplicates carries a hint (ray/_private/ray_logging/__init__.py, _warn_once).
HINT = (" (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication, or see "
        "https://docs.ray.io/en/master/ray-observability/user-guides/configure-logging.html#log-deduplication "
        "for more options.)")
JOB_LOG = "\n".join([
    f"{WORKER} Error in training function:",
    *(f"{WORKER} {line}" for line in TRACEBACK),
    f"{WORKER}",
    f"{WORKER}     print('  indented output of the loop is not a traceback')",
    f"{CONTROLLER} {TRACEBACK[0]}{REPEATED}{HINT}",
    *(f"{CONTROLLER} {line}{REPEATED}" for line in TRACEBACK[1:]),
    f"{CONTROLLER} [FailurePolicy] RAISE",
    f"{WORKER}   an indented line the loop printed",
    "error: training failed on ranks 0, 1",
]) + "\n"


def test_an_actors_traceback_shows_as_its_header_and_exception_line() -> None:
    shown = JobLogFollower().shown(JOB_LOG)
    assert shown == [
        f"{WORKER} Error in training function:",
        f"{WORKER} Traceback (most recent call last): (frames: in the Ray dashboard's job log)",
        f"{WORKER} ValueError: could not convert string to float: 'fast'",
        f"{WORKER}     print('  indented output of the loop is not a traceback')",
        f"{CONTROLLER} Traceback (most recent call last):{REPEATED}{HINT} (frames: in the Ray dashboard's job log)",
        f"{CONTROLLER} ValueError: could not convert string to float: 'fast'{REPEATED}",
        f"{CONTROLLER} [FailurePolicy] RAISE",
        f"{WORKER}   an indented line the loop printed",
        "error: training failed on ranks 0, 1",
    ]


def test_an_actors_traceback_whose_header_ray_deduplicated_folds_too() -> None:
    """Ray's log deduplication may print one actor's ``Traceback`` header for all and hold the others back;
    their frames still fold, under a header of their own."""
    headless = [f"{WORKER} Error in training function:", *(f"{WORKER} {line}" for line in TRACEBACK[1:])]
    assert JobLogFollower().shown("\n".join(headless)) == [
        f"{WORKER} Error in training function:",
        f"{WORKER} Traceback (most recent call last): (frames: in the Ray dashboard's job log)",
        f"{WORKER} ValueError: could not convert string to float: 'fast'",
    ]


def test_a_chained_traceback_folds_whole() -> None:
    chained = [f"{WORKER} {line}" for line in [
        "Traceback (most recent call last):", '  File "a.py", line 1, in f', "KeyError: 'lr'", "",
        "During handling of the above exception, another exception occurred:", "",
        "Traceback (most recent call last):", '  File "a.py", line 3, in f', "ValueError: no learning rate"]]
    assert JobLogFollower().shown("\n".join(chained)) == [
        f"{WORKER} Traceback (most recent call last): (frames: in the Ray dashboard's job log)",
        f"{WORKER} KeyError: 'lr'",
        f"{WORKER} During handling of the above exception, another exception occurred:",
        f"{WORKER} Traceback (most recent call last): (frames: in the Ray dashboard's job log)",
        f"{WORKER} ValueError: no learning rate",
    ]


def test_the_trainers_driver_prints_the_loops_traceback_once_without_the_providers_frame() -> None:
    driven = user_traceback("\n".join(TRACEBACK))
    assert driven.splitlines() == [
        "Traceback (most recent call last):",
        '  File "pipeline/train_loop.py", line 177, in train_loop_per_worker',
        "    train(config)",
        '  File "pipeline/train_loop.py", line 101, in train',
        '    optimizer = make_optimizer(float(config["learning_rate"]))',
        "                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "ValueError: could not convert string to float: 'fast'",
    ]


def test_the_drivers_line_names_the_ranks_and_shows_the_first_errors_traceback() -> None:
    # WorkerGroupError's message: one snippet per distinct error (ray/train/v2/.../worker_group/poll.py).
    snippets = "\n".join(["[Rank 0,1 Error Snippet]:", *TRACEBACK, "[Rank 2 Error Snippet]:", "OOM"])
    printed = describe_failure(RuntimeError(f"Training failed due to worker errors:\n{snippets}"))
    assert printed.splitlines()[-2:] == [
        "ValueError: could not convert string to float: 'fast'",
        "error: training failed on ranks 0, 1; rank 2 failed otherwise (Ray Train's controller says how, above)"]
    assert printed.count("Traceback (most recent call last):") == 1 and "run_user_loop" not in printed
    assert describe_failure(RuntimeError(f"placement failed in {PKG}/_ray_pkg_ab12/x.py")) == \
        "error: training failed: placement failed in x.py"


@pytest.mark.parametrize(("log", "error"), [
    (JOB_LOG.replace("error: training failed", "\n".join([*user_traceback("\n".join(TRACEBACK)).splitlines(),
                                                           "error: training failed"])),
     JobError("ValueError: could not convert string to float: 'fast'", "pipeline/train_loop.py, line 101, in train")),
    # A script's own uncaught exception, the last thing it printed.
    ('Traceback (most recent call last):\n  File "/app/job.py", line 3, in <module>\n    main()\n'
     "RuntimeError: shard 7 is corrupt\n",
     JobError("RuntimeError: shard 7 is corrupt", "/app/job.py, line 3, in <module>")),
    # Only actors' tracebacks: the driver printed none.
    (JOB_LOG, None),
    # A traceback the script printed and survived, then more output: not how the job ended.
    ('Traceback (most recent call last):\n  File "/app/job.py", line 3, in <module>\nKeyError: 1\nretrying\n'
     "step 1\nstep 2\nstep 3\nexiting with code 3\n", None),
])
def test_the_tasks_error_is_the_exception_the_driver_ended_with(log: str, error: JobError | None) -> None:
    assert job_error(log) == error


def test_paths_in_rays_packages_read_as_written() -> None:
    unpacked = f'File "{PKG}/_ray_pkg_a145936bb24da232/pipeline/train_loop.py"'
    assert as_written(unpacked) == 'File "pipeline/train_loop.py"'
    assert as_written("/app/job.py") == "/app/job.py"
