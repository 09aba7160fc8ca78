"""StepClock outside Ray Train: step times, a JAX profiler trace copied to GCS in TensorBoard's layout, and the
records of how far each attempt of a run got.

No Ray: a jitted step on the CPU and the fake GCS. (Inside Ray Train, tests/ray/local_backend/test_training.py
profiles a real two-worker run.)
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_raytpu.workloads.progress import ATTEMPT_PREFIX, training_progress
from airflow_provider_raytpu.workloads.steps import StepClock, combine_step_times, read_step_times
from tests.support.gcs import GcsStorage, wait_for


@pytest.fixture
def run_uri(fake_gcs: GcsStorage) -> str:
    return fake_gcs.uri()


def test_a_profiled_window_leaves_a_trace_tensorboard_reads_and_a_summary(run_uri: str, fake_gcs: GcsStorage) -> None:
    import jax
    import jax.numpy as jnp

    step_fn = jax.jit(lambda x: (x @ x).sum())
    clock = StepClock({"profile_steps": [2, 4], "profile_uri": f"{run_uri}/profile"}, rank=1,
                      steps_uri=f"{run_uri}/steps")
    for step in range(6):
        with clock.step(step):
            with clock.data():
                batch = jnp.full((64, 64), float(step))
            float(step_fn(batch))
    clock.close()

    prefix = run_uri.split("/", 3)[3]
    trace = f"{prefix}/profile/plugins/profile/steps-2-4/"
    names = {name[len(trace):] for name in fake_gcs.objects(trace)}
    assert "worker-1.xplane.pb" in names, names  # <logdir>/plugins/profile/<run>/<host>.xplane.pb
    assert clock.summary()["trace_uri"] == f"{run_uri}/profile/plugins/profile/steps-2-4"

    (summary,) = read_step_times(f"{run_uri}/steps")
    assert summary == json.loads(json.dumps(clock.summary()))
    assert summary["rank"] == 1 and summary["steps"] == 6
    assert summary["first_step_s"] is not None  # compilation, kept apart from the median and p95
    assert 0 < summary["median_s"] <= summary["p95_s"]
    assert 0 <= summary["data_wait_share"] <= 1
    assert combine_step_times([summary])["workers"] == 1


def test_no_window_no_trace(run_uri: str, fake_gcs: GcsStorage) -> None:
    clock = StepClock({}, rank=0, steps_uri=f"{run_uri}/steps")
    with clock.step(0):
        pass
    clock.close()
    assert clock.summary()["trace_uri"] is None and clock.summary()["median_s"] is None
    assert not fake_gcs.objects(f"{run_uri.split('/', 3)[3]}/profile")


def attempt_records(attempts_uri: str) -> list[dict]:
    """The attempt records in storage, read as the training task reads them (the Google provider's GCS hook)."""
    from airflow_provider_raytpu.hooks.run_files import read_files

    return [json.loads(data) for data in read_files(attempts_uri, ATTEMPT_PREFIX, "google_cloud_default").values()]


def test_rank_0_records_its_attempt_at_the_first_step_while_it_trains_and_at_close(run_uri: str) -> None:
    attempts_uri = f"{run_uri}/attempts"
    clock = StepClock({}, rank=0, steps_uri=f"{run_uri}/steps", attempts_uri=attempts_uri)
    other = StepClock({}, rank=1, steps_uri=f"{run_uri}/steps", attempts_uri=attempts_uri)
    assert clock.progress is not None and other.progress is None  # the workers step together: rank 0 speaks
    clock.progress.every_s = 0.2
    with clock.step(10):  # resumed from the checkpoint at step 10
        pass
    (first,) = attempt_records(attempts_uri)
    assert (first["first_step"], first["reached"]) == (10, 11)
    for step in range(11, 14):
        with clock.step(step):
            pass
    # The loop now hangs (a host is going away): the background write still records step 14 reached.
    assert wait_for(lambda: [r["reached"] for r in attempt_records(attempts_uri)] == [14], timeout=10)
    with clock.step(14):
        pass
    clock.close()
    assert [(r["first_step"], r["reached"]) for r in attempt_records(attempts_uri)] == [(10, 15)]
    assert not clock.progress._thread.is_alive()


def test_a_second_attempt_has_a_record_of_its_own_and_the_restart_lost_the_steps_beyond_its_checkpoint(
        run_uri: str) -> None:
    attempts_uri = f"{run_uri}/attempts"
    for first, end in ((0, 17), (10, 30)):  # a preempted slice at 17, resumed from the checkpoint at 10
        clock = StepClock({}, rank=0, attempts_uri=attempts_uri)
        for step in range(first, end):
            with clock.step(step):
                pass
        clock.close()
    progress = training_progress(attempt_records(attempts_uri))
    assert (progress["attempts"], progress["steps_lost"], progress["lost"]) == (
        2, 7, [{"reached": 17, "resumed_from": 10, "steps_lost": 7}])
