"""Orbax checkpoints straight to storage: round trip, retention, and partial step directories left by a crash.

These run the manager outside Ray Train (no registration); inside Ray Train it is
exercised by the fault-tolerance tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from airflow_provider_raytpu.workloads import storage
from airflow_provider_raytpu.workloads.checkpoints import TrainCheckpoints
from tests.support.gcs import GcsStorage


def state_at(step: int) -> dict:
    import jax.numpy as jnp

    return {"params": {"w": jnp.arange(6.0).reshape(2, 3) + step, "b": jnp.full((3,), float(step))},
            "count": jnp.int32(step)}


def template() -> dict:
    import jax.numpy as jnp

    return {"params": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}, "count": jnp.int32(0)}


def assert_state(state: dict, step: int) -> None:
    expected = state_at(step)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(expected["params"]["w"]))
    np.testing.assert_array_equal(np.asarray(state["params"]["b"]), np.asarray(expected["params"]["b"]))
    assert int(state["count"]) == step


@pytest.fixture(params=["gcs", "local"])
def checkpoint_uri(request: pytest.FixtureRequest, fake_gcs: GcsStorage, tmp_path: Path) -> str:
    return fake_gcs.uri() if request.param == "gcs" else str(tmp_path / "ckpt")


def step_dirs(uri: str) -> list[str]:
    """Top-level names under ``uri``, read from storage directly."""
    location = storage.resolve(uri)
    return sorted(
        {p[len(location.path) + 1:].split("/")[0] for p in storage.list_files(uri)}
    )


def test_fresh_start_restores_nothing(checkpoint_uri: str) -> None:
    with TrainCheckpoints(checkpoint_uri, report=False) as checkpoints:
        assert checkpoints.restore_latest(template()) is None
        assert checkpoints.resumed_from_step is None


def test_round_trip_and_retention(checkpoint_uri: str) -> None:
    with TrainCheckpoints(checkpoint_uri, max_to_keep=2, report=False) as checkpoints:
        for step in (5, 10, 15):
            checkpoints.save(step, state_at(step), {"loss": 1.0 / step})
    assert step_dirs(checkpoint_uri) == ["10", "15"]

    with TrainCheckpoints(checkpoint_uri, max_to_keep=2, report=False) as checkpoints:
        step, state = checkpoints.restore_latest(template())
        assert step == 15 and checkpoints.resumed_from_step == 15
        assert_state(state, 15)
        assert checkpoints.step_uri(15) == storage.resolve(checkpoint_uri).child("15").uri


def plant_partial_step(checkpoint_uri: str, from_step: int, to_step: int) -> str:
    """Leave ``to_step`` as a crash mid-save would: the files of a step, but never committed.

    On GCS orbax writes into the step prefix and marks it done with commit_success.txt
    last; locally it writes a ``*.orbax-checkpoint-tmp-*`` directory and renames it.
    """
    location = storage.resolve(checkpoint_uri)
    fs = location.filesystem
    source = location.child(str(from_step)).path
    if location.is_gcs:
        target = location.child(str(to_step)).path
        files = [p for p in storage.list_files(location.child(str(from_step)).uri)
                 if not p.endswith("commit_success.txt")]
    else:
        target = location.child(f"{to_step}.orbax-checkpoint-tmp-1767225600123").path
        files = storage.list_files(location.child(str(from_step)).uri)
    for path in files:
        destination = target + path[len(source):]
        fs.create_dir(destination.rsplit("/", 1)[0], recursive=True)
        fs.copy_file(path, destination)
    assert storage.exists(location.child(target.rsplit("/", 1)[1]).uri)
    return target.rsplit("/", 1)[1]


def test_a_partial_step_from_a_crash_breaks_neither_restore_nor_save(checkpoint_uri: str) -> None:
    with TrainCheckpoints(checkpoint_uri, report=False) as checkpoints:
        for step in (5, 10):
            checkpoints.save(step, state_at(step))
    partial = plant_partial_step(checkpoint_uri, from_step=10, to_step=15)
    assert partial in step_dirs(checkpoint_uri)

    with TrainCheckpoints(checkpoint_uri, report=False) as checkpoints:
        assert checkpoints.all_steps() == [5, 10]
        step, state = checkpoints.restore_latest(template())
        assert step == 10
        assert_state(state, 10)
        checkpoints.save(15, state_at(15))  # the step the crash left half-written
        checkpoints.save(20, state_at(20))
    # The partial directory is gone (locally its tmp name; on GCS "15" now holds the new save).
    assert step_dirs(checkpoint_uri) == ["10", "15", "20"]

    import orbax.checkpoint as ocp

    with TrainCheckpoints(checkpoint_uri, report=False) as checkpoints:
        assert checkpoints.all_steps() == [10, 15, 20]
    manager = ocp.CheckpointManager(storage.resolve(checkpoint_uri).orbax_path)
    assert_state(manager.restore(15, args=ocp.args.StandardRestore(template())), 15)  # the new save, not stale files
    manager.close()


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        TrainCheckpoints("/tmp/x", max_to_keep=0, report=False)
    with pytest.raises(ValueError, match="storage_uri is required"):
        TrainCheckpoints(None, report=False)
