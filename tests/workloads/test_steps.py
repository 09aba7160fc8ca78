"""StepClock outside Ray Train: step times, and a JAX profiler trace copied to GCS in TensorBoard's layout.

No Ray: a jitted step on the CPU and the fake GCS. (Inside Ray Train, tests/local/test_training.py
profiles a real two-worker run.)
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_raytpu.workloads.steps import StepClock, combine_step_times, read_step_times
from tests.gcs import GcsStorage


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
