"""Ragged final batches: drop, pad with a mask, or refuse - on the driver before fit() and in the loop."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from airflow_provider_raytpu.workloads.batches import MASK_COLUMN, RaggedBatchError, check_batches, iter_batches
from tests.ray.workloads.batches_four_devices import CASES, DEVICES, NUMERIC, TENSORS, TEXT_COLUMNS
from tests.ray.workloads.ray_slice import REPO, EmulatedSlice, driver_env


def test_even_split_passes_every_policy() -> None:
    for policy in ("drop", "pad", "raise"):
        plan = check_batches(1024, 64, 2, policy)
        assert (plan.rows_per_worker, plan.full_batches, plan.ragged_rows, plan.batches_per_epoch) == (512, 8, 0, 8)
        assert not plan.is_ragged and plan.rows_used_per_epoch == 1024


def test_raise_fails_on_the_driver_naming_rows_batch_size_and_workers() -> None:
    with pytest.raises(RaggedBatchError) as error:
        check_batches(1000, 64, 2, "raise")
    message = str(error.value)
    assert "1000 rows" in message and "batch_size=64" in message and "2 workers" in message
    assert "last batch would hold 52 rows" in message  # 500 rows per worker = 7 x 64 + 52
    assert "ragged_policy='drop'" in message and "'pad'" in message  # what to do
    assert "896 or 1024 rows" in message  # the nearest dataset sizes that split evenly
    assert "such as" in message and "50" in message  # or a batch size that divides 500


def test_raise_also_refuses_rows_the_equal_split_would_leave_out() -> None:
    with pytest.raises(RaggedBatchError, match="leaves out 1"):
        check_batches(129, 64, 2, "raise")


def test_drop_and_pad_plans() -> None:
    drop = check_batches(1000, 64, 2, "drop")
    assert (drop.batches_per_epoch, drop.rows_used_per_epoch) == (7, 896)
    pad = check_batches(1000, 64, 2, "pad")
    assert (pad.batches_per_epoch, pad.rows_used_per_epoch) == (8, 1000)


def test_drop_with_less_than_a_batch_per_worker_is_an_error() -> None:
    with pytest.raises(ValueError, match="no batch would be left"):
        check_batches(100, 64, 2, "drop")
    assert check_batches(100, 64, 2, "pad").batches_per_epoch == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [((10, 4, 2, "truncate"), "ragged_policy"), ((10, 0, 2, "pad"), "batch_size"), ((10, 4, 0, "pad"), "num_workers"),
     ((-1, 4, 2, "pad"), "num_rows")],
)
def test_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_batches(*args)


@pytest.fixture(scope="module")
def ten_rows(ray_client: EmulatedSlice):  # noqa: ANN201
    import ray.data

    return ray.data.from_items(
        [{"x": np.full(3, float(i), np.float32), "y": float(i), "text": f"row {i}"} for i in range(10)]
    ).repartition(1)


def collect(batches) -> list[dict[str, np.ndarray]]:  # noqa: ANN001
    return [{k: np.asarray(v) for k, v in batch.items()} for batch in batches]


@pytest.mark.ray
def test_iter_batches_drop(ten_rows) -> None:  # noqa: ANN001
    batches = collect(iter_batches(ten_rows, 4, "drop", columns=["x", "y"]))
    assert [len(b["y"]) for b in batches] == [4, 4]
    assert sorted(np.concatenate([b["y"] for b in batches]).tolist()) == [float(i) for i in range(8)]
    assert MASK_COLUMN not in batches[0]


@pytest.mark.ray
def test_iter_batches_pad_masks_exactly_the_padded_rows(ten_rows) -> None:  # noqa: ANN001
    import jax.numpy as jnp

    batches = collect(iter_batches(ten_rows, 4, "pad", columns=["x", "y"], dtypes=jnp.float32, pad_value=-1))
    assert [b["x"].shape for b in batches] == [(4, 3)] * 3
    last = batches[-1]
    assert last[MASK_COLUMN].dtype == bool and last[MASK_COLUMN].tolist() == [True, True, False, False]
    assert last["y"][2:].tolist() == [-1.0, -1.0]
    # Every real row counts exactly once; padded rows drop out of a masked sum.
    ys = np.concatenate([b["y"][b[MASK_COLUMN]] for b in batches])
    assert sorted(ys.tolist()) == [float(i) for i in range(10)]
    assert sum(int(b[MASK_COLUMN].sum()) for b in batches) == 10


@pytest.mark.ray
def test_iter_batches_raise(ten_rows) -> None:  # noqa: ANN001
    batches = iter_batches(ten_rows, 4, "raise", columns=["x", "y"])
    assert len(next(batches)["y"]) == 4 and len(next(batches)["y"]) == 4
    with pytest.raises(RaggedBatchError, match="2 rows per worker, not batch_size=4"):
        next(batches)


@pytest.mark.ray
def test_iter_batches_pad_refuses_an_existing_mask_column(ray_client: EmulatedSlice) -> None:
    import ray.data

    data = ray.data.from_items([{"y": 1.0, MASK_COLUMN: True}] * 3)
    with pytest.raises(Exception, match="already has a 'mask' column"):
        collect(iter_batches(data, 2, "pad"))


@pytest.fixture(scope="module")
def four_devices(ray_slice: EmulatedSlice) -> dict[str, dict[str, Any]]:
    """Every case of ``batches_four_devices`` run through both paths in a process with 4 JAX CPU devices.

    XLA_FLAGS must be set before JAX is imported, hence a process of its own.
    """
    env = {**driver_env(ray_slice), "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.ray.workloads.batches_four_devices"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix = "RAYTPU_CASE "
    return {r["case"]: r for r in (json.loads(line[len(prefix):]) for line in proc.stdout.splitlines()
                                   if line.startswith(prefix))}


@pytest.mark.ray
@pytest.mark.parametrize(("case", "dataset", "policy", "dtypes", "with_columns"), CASES, ids=[c[0] for c in CASES])
def test_fast_path_makes_rays_arrays_on_four_devices(
    four_devices: dict[str, dict[str, Any]], case: str, dataset: str, policy: str, dtypes: str, with_columns: bool
) -> None:
    """Same arrays bit for bit (dtype, shape, sharding, rows per device) and the same errors as iter_jax_batches."""
    result = four_devices[case]
    assert result["problems"] == []
    if dtypes == "dict_missing":  # Ray's KeyError for a column dtypes does not name
        assert (result["fast_error"], result["ray_error"], result["batches"]) == ("KeyError", "KeyError", 0)
        return
    columns = TEXT_COLUMNS if with_columns else TENSORS if dataset == "tensors" else NUMERIC
    assert result["columns"] == columns + ([MASK_COLUMN] if policy == "pad" else [])
    assert result["batches"] == {"drop": 3, "pad": 4, "raise": 3}[policy]
    if policy == "raise":  # the short 4th batch: 6 rows (not a multiple of 4 devices) or 4 rows
        assert result["fast_error"] == "RaggedBatchError"
        assert result["ray_error"] == ("RaggedBatchError" if with_columns else "ValueError")
        assert f"batch 3 has {4 if with_columns else 6} rows per worker" in result["fast_message"]
    else:
        assert result["fast_error"] is None and result["ray_error"] is None
    if dtypes == "one":  # one dtype casts every column; the mask stays boolean only when columns are named
        assert result["dtypes"] == (["bfloat16", "bool"] if policy == "pad" and with_columns else ["bfloat16"])
