"""Fault tolerance of the training job on an emulated v4 2x2x2 slice with checkpoints in (fake) GCS.

Every scenario is checked against one uninterrupted run with the same seed: the final
parameters must match within 1e-6, and the work lost - steps done before the fault
minus the step training resumed from - must be at most one checkpoint interval. The
attempts' records in storage count exactly those lost steps (the training task's
``training_attempts``).
Batches derive from (seed, step), so a resumed run recomputes exactly the same steps.

The fault is injected at a known step: the loop pauses once there (see
``fault_loop.py``), the test waits until the newest checkpoint before it is committed
in storage, then breaks something. Scenarios b and c start from one crashed job (driver
killed with -9) whose storage is copied, untouched, to one run name per scenario.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from airflow_provider_raytpu.workloads import storage
from airflow_provider_raytpu.workloads.progress import ATTEMPT_PREFIX, ATTEMPTS_SUBDIR, training_progress
from airflow_provider_raytpu.workloads.result import last_result
from tests.ray.workloads.ray_slice import REPO, SLICE, EmulatedSlice, driver_env
from tests.support.gcs import GcsStorage, wait_for

pytestmark = [
    pytest.mark.ray,
    # Popen after JAX is imported here (to read checkpoints): JAX warns about fork, but exec follows at once.
    pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),
]

TOTAL_STEPS = 30
EVERY = 5  # checkpoint interval, in steps
SEED = 11
LOOP = "tests.ray.workloads.fault_loop:train_loop_per_worker"
TOLERANCE = 1e-6


class Driver:
    """A training job driver run as its own process (``python -m ...workloads.train``), logs to files."""

    def __init__(self, args: list[str], env: dict[str, str], log_dir: Path, name: str) -> None:
        self.stdout_path = log_dir / f"{name}.out"
        self.stderr_path = log_dir / f"{name}.err"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "airflow_provider_raytpu.workloads.train", *args],
                cwd=REPO, env=env, stdout=out, stderr=err,
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"driver did not finish in {timeout}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """kill -9: the job's driver vanishes without any cleanup."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def result(self) -> dict[str, Any]:
        result = last_result(self.stdout_path.read_text())
        assert result is not None, f"no RAYTPU_RESULT line:\n{self.log_tail()}"
        return result

    def log_tail(self, chars: int = 4000) -> str:
        return self.stdout_path.read_text()[-chars:] + "\n--- stderr ---\n" + self.stderr_path.read_text()[-chars:]


@pytest.fixture(scope="module")
def runs_uri(fake_gcs: GcsStorage) -> str:
    return fake_gcs.uri("fault-tolerance")


def start_driver(
    ray_slice: EmulatedSlice, runs_uri: str, run_name: str, tmp_path: Path, *, pause_at: int | None, max_failures: int,
    name: str, rerun: bool = False,
) -> Driver:
    """A driver of ``run_name``; a ``rerun`` resumes it with the fault knobs of its config (``marker_dir``,
    ``pause_at_step``) changed, which ``--on-config-change resume`` allows."""
    config = {"seed": SEED, "total_steps": TOTAL_STEPS, "checkpoint_every": EVERY, "batch_size": 16,
              "marker_dir": str(tmp_path), "pause_at_step": pause_at}
    args = [
        "--train-loop", LOOP, "--tpu", json.dumps(SLICE.to_dict()), "--run-name", run_name,
        "--checkpoint-uri", runs_uri, "--config", json.dumps(config), "--max-failures", str(max_failures),
        "--checkpoints-to-keep", "3", *(["--on-config-change", "resume"] if rerun else []),
    ]
    return Driver(args, driver_env(ray_slice), tmp_path, name)


def orbax_uri(runs_uri: str, run_name: str) -> str:
    return f"{runs_uri}/{run_name}/orbax"


def attempts_reached(runs_uri: str, run_name: str) -> list[tuple[int, int]]:
    """``(first step, steps reached)`` of each attempt of the run, oldest first, as the training task reads them."""
    records = sorted(attempts(runs_uri, run_name), key=lambda r: r["started_at"])
    return [(r["first_step"], r["reached"]) for r in records]


def attempts(runs_uri: str, run_name: str) -> list[dict[str, Any]]:
    from airflow_provider_raytpu.hooks.run_files import read_files

    files = read_files(f"{runs_uri}/{run_name}/{ATTEMPTS_SUBDIR}", ATTEMPT_PREFIX, "google_cloud_default")
    return [json.loads(data) for data in files.values()]


def committed(runs_uri: str, run_name: str, step: int) -> bool:
    return storage.exists(f"{orbax_uri(runs_uri, run_name)}/{step}/commit_success.txt")


def final_state(checkpoint_uri: str) -> dict[str, Any]:
    """Restore a step directory written by the 2-process job into this single process, as numpy."""
    import jax
    import orbax.checkpoint as ocp

    from example_dags.pipeline.model import init_params, make_optimizer

    params = init_params(SEED)
    template = {"params": params, "opt_state": make_optimizer(0.01).init(params)}
    directory, step = checkpoint_uri.rsplit("/", 1)
    with ocp.CheckpointManager(storage.resolve(directory).orbax_path) as manager:
        state = manager.restore(int(step), args=ocp.args.StandardRestore(template))
    return jax.tree.map(np.asarray, state)


def assert_same_state(state: dict[str, Any], reference: dict[str, Any]) -> float:
    import jax

    differences = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(np.max(np.abs(a - b), initial=0.0)), state, reference))
    worst = max(differences)
    assert worst <= TOLERANCE, f"final state differs from the uninterrupted run by {worst}"
    return worst


def wait_until_paused(driver: Driver, marker_dir: Path, step: int) -> None:
    marker = marker_dir / f"paused-at-{step}"
    if not wait_for(lambda: marker.exists() or driver.process.poll() is not None, timeout=300):
        pytest.fail(f"training never reached step {step}:\n{driver.log_tail()}")
    assert marker.exists(), f"driver exited before step {step}:\n{driver.log_tail()}"


def record(
    record_property: Any,
    scenario: str,
    started: float,
    paused_at: int,
    result: dict[str, Any],
    worst: float,
    reference_seconds: float,
    **extra: float,
) -> None:
    """Attach the scenario's figures to the test report; conftest prints them in the terminal summary."""
    record_property(
        "fault_tolerance",
        {
            "scenario": scenario,
            "wall_seconds": round(time.monotonic() - started + sum(extra.values()), 1),
            **extra,
            "fault_at_step": paused_at,
            "resumed_from_step": result["resumed_from_step"],
            "steps_lost": paused_at - result["resumed_from_step"],
            "checkpoint_interval": EVERY,
            "max_abs_param_difference": worst,
            "uninterrupted_run_seconds": reference_seconds,
        },
    )


@pytest.fixture(scope="module")
def reference(ray_slice: EmulatedSlice, runs_uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run with the same seed; its result and final state."""
    started = time.monotonic()
    driver = start_driver(ray_slice, runs_uri, "reference", tmp_path_factory.mktemp("reference"), pause_at=None,
                          max_failures=0, name="reference")
    assert driver.wait(timeout=400) == 0, driver.log_tail()
    result = driver.result()
    assert result["steps"] == TOTAL_STEPS and result["resumed_from_step"] is None
    assert result["checkpoint_uri"] == f"{orbax_uri(runs_uri, 'reference')}/{TOTAL_STEPS}"
    seconds = round(time.monotonic() - started, 1)
    return {"result": result, "state": final_state(result["checkpoint_uri"]), "seconds": seconds}


@pytest.fixture
def whole_slice(ray_slice: EmulatedSlice) -> Iterator[EmulatedSlice]:
    yield ray_slice
    ray_slice.ensure_hosts()


def test_a_tpu_host_dies_and_ray_train_resumes_on_the_replacement(
    whole_slice: EmulatedSlice, runs_uri: str, reference: dict[str, Any], tmp_path: Path, record_property: Any
) -> None:
    started, pause_at, run = time.monotonic(), 13, "host-dies"
    driver = start_driver(whole_slice, runs_uri, run, tmp_path, pause_at=pause_at, max_failures=2, name=run)
    wait_until_paused(driver, tmp_path, pause_at)
    assert wait_for(lambda: committed(runs_uri, run, 10), timeout=60), "checkpoint 10 never committed"
    # The paused loop's progress reaches storage within PROGRESS_EVERY_S (a background write).
    assert wait_for(lambda: attempts_reached(runs_uri, run) == [(0, pause_at)], timeout=30), attempts(runs_uri, run)

    whole_slice.kill_host(1)  # the VM behind TPU host 1 is gone
    whole_slice.add_host(1)  # KubeRay recreates the host with the same slice labels

    assert driver.wait(timeout=400) == 0, driver.log_tail()
    result = driver.result()
    assert result["steps"] == TOTAL_STEPS
    assert result["resumed_from_step"] == 10  # the worker group restarted inside the same job
    assert pause_at - result["resumed_from_step"] <= EVERY
    assert training_progress(attempts(runs_uri, run)) == {
        "attempts": 2, "restarts": 1, "steps_lost": 3, "started_at_step": 0,
        "lost": [{"reached": pause_at, "resumed_from": 10, "steps_lost": 3}]}
    worst = assert_same_state(final_state(result["checkpoint_uri"]), reference["state"])
    assert result["metrics"]["holdout_loss"] == pytest.approx(reference["result"]["metrics"]["holdout_loss"],
                                                              abs=TOLERANCE)
    record(record_property, "a: TPU host dies mid-training", started, pause_at, result, worst, reference["seconds"])


def ray_registered(runs_uri: str, run: str) -> list[int]:
    """The steps in Ray Train's own record of the run (its checkpoint manager snapshot)."""
    snapshot = storage.resolve(f"{runs_uri}/{run}/checkpoint_manager_snapshot.json")
    if not storage.exists(snapshot.uri):
        return []
    with snapshot.filesystem.open_input_stream(snapshot.path) as stream:
        results = json.loads(stream.read())["checkpoint_results"]
    return [int(r["checkpoint_dir_name"].rsplit("/", 1)[1]) for r in results]


def orbax_steps(fake_gcs: GcsStorage, runs_uri: str, run: str) -> list[int]:
    """Step directories under the run's orbax prefix, straight from the server.

    The prefix's own directory marker (written when a step is registered with Ray) names no step.
    """
    prefix = f"{runs_uri.split('/', 3)[3]}/{run}/orbax/"
    return sorted({int(name[len(prefix):].split("/")[0]) for name in fake_gcs.objects(prefix) if name != prefix})


def copy_prefix(source_uri: str, target_uri: str, keep: Any = lambda path: True) -> list[str]:
    """Copy every object under ``source_uri`` to the same relative path under ``target_uri``."""
    source, target = storage.resolve(source_uri), storage.resolve(target_uri)
    copied = []
    for path in storage.list_files(source.uri):
        if keep(path):
            destination = target.path + path[len(source.path):]
            source.filesystem.copy_file(path, destination)
            copied.append(destination)
    return copied


CRASH_AT = 27


@pytest.fixture(scope="module")
def crashed_runs(
    ray_slice: EmulatedSlice, fake_gcs: GcsStorage, runs_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A job whose driver is killed (-9) at step 27, its storage copied untouched to one run per scenario.

    By then five checkpoints exist, so Ray's retention (3) has already pruned one: the
    re-run must resume against storage where Ray, not orbax, deleted step 5.
    """
    started, run = time.monotonic(), "crashed"
    marker_dir = tmp_path_factory.mktemp("crashed")
    driver = start_driver(ray_slice, runs_uri, run, marker_dir, pause_at=CRASH_AT, max_failures=0, name=run)
    wait_until_paused(driver, marker_dir, CRASH_AT)
    assert wait_for(lambda: committed(runs_uri, run, 25), timeout=60), "checkpoint 25 never committed"
    # Ray registers a step once committed, at the next save: its record names 10..20 while
    # storage also holds the committed 25. Ray itself pruned 5 (it owns retention).
    assert wait_for(lambda: 20 in ray_registered(runs_uri, run), timeout=60), ray_registered(runs_uri, run)
    assert ray_registered(runs_uri, run) == [10, 15, 20]
    # Ray writes its record first and deletes the pruned step's files after.
    assert wait_for(lambda: orbax_steps(fake_gcs, runs_uri, run) == [10, 15, 20, 25], timeout=60), \
        orbax_steps(fake_gcs, runs_uri, run)
    assert wait_for(lambda: attempts_reached(runs_uri, run) == [(0, CRASH_AT)], timeout=30), attempts(runs_uri, run)
    driver.kill()
    assert last_result(driver.stdout_path.read_text()) is None
    for scenario in ("driver-dies", "partial-step"):
        assert copy_prefix(f"{runs_uri}/{run}", f"{runs_uri}/{scenario}")
    return {"crash_phase_seconds": round(time.monotonic() - started, 1)}


def test_b_the_driver_dies_and_a_rerun_resumes_from_gcs(
    ray_slice: EmulatedSlice, fake_gcs: GcsStorage, runs_uri: str, reference: dict[str, Any],
    crashed_runs: dict[str, Any], tmp_path: Path, record_property: Any,
) -> None:
    started, run = time.monotonic(), "driver-dies"
    rerun = start_driver(ray_slice, runs_uri, run, tmp_path, pause_at=None, max_failures=0, name="rerun", rerun=True)
    assert rerun.wait(timeout=400) == 0, rerun.log_tail()
    result = rerun.result()
    assert result["steps"] == TOTAL_STEPS
    assert result["resumed_from_step"] == 25  # orbax's newest committed step in GCS, ahead of Ray's record
    assert CRASH_AT - result["resumed_from_step"] <= EVERY
    # The crashed job's attempt and the re-run's: the re-run (an Airflow retry's job) lost the steps after 25.
    assert attempts_reached(runs_uri, run) == [(0, CRASH_AT), (25, TOTAL_STEPS)]
    assert training_progress(attempts(runs_uri, run))["steps_lost"] == CRASH_AT - 25
    worst = assert_same_state(final_state(result["checkpoint_uri"]), reference["state"])
    # The resumed step was registered late, so Ray's retention covers it: nothing leaks.
    assert orbax_steps(fake_gcs, runs_uri, run) == [20, 25, 30]
    assert ray_registered(runs_uri, run) == [20, 25, 30]
    record(record_property, "b: job driver killed (-9), job re-run", started, CRASH_AT, result, worst,
           reference["seconds"], crash_phase_seconds=crashed_runs["crash_phase_seconds"])


def test_c_a_partial_step_directory_left_by_a_crash_does_not_stop_the_resume(
    ray_slice: EmulatedSlice, fake_gcs: GcsStorage, runs_uri: str, reference: dict[str, Any],
    crashed_runs: dict[str, Any], tmp_path: Path, record_property: Any,
) -> None:
    started, run = time.monotonic(), "partial-step"
    # The crash hit while step 30 was being written: on GCS that leaves its files but no
    # commit_success.txt. It is the newest step directory, so "latest by name" would pick it.
    orbax = orbax_uri(runs_uri, run)
    assert copy_prefix(f"{orbax}/25", f"{orbax}/30", keep=lambda path: not path.endswith("commit_success.txt"))
    assert orbax_steps(fake_gcs, runs_uri, run) == [10, 15, 20, 25, 30] and not committed(runs_uri, run, 30)

    rerun = start_driver(ray_slice, runs_uri, run, tmp_path, pause_at=None, max_failures=0, name="rerun", rerun=True)
    assert rerun.wait(timeout=400) == 0, rerun.log_tail()
    result = rerun.result()
    assert result["steps"] == TOTAL_STEPS
    assert result["resumed_from_step"] == 25  # the newest *committed* step, not the partial 30
    assert CRASH_AT - result["resumed_from_step"] <= EVERY
    worst = assert_same_state(final_state(result["checkpoint_uri"]), reference["state"])
    # Step 30 was written anew and committed; retention kept the newest three.
    assert orbax_steps(fake_gcs, runs_uri, run) == [20, 25, 30] and committed(runs_uri, run, 30)
    record(record_property, "c: partial step directory after a crash", started, CRASH_AT, result, worst,
           reference["seconds"], crash_phase_seconds=crashed_runs["crash_phase_seconds"])
