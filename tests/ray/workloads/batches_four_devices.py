"""Driver for the fast-path equality test: both paths of ``iter_batches`` on 4 emulated JAX CPU devices.

Run as ``python -m tests.ray.workloads.batches_four_devices`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (JAX reads it once, at import, so
the test starts this in its own process) and ``RAY_ADDRESS`` pointing at a running
cluster. For every case in :data:`CASES` it iterates the same dataset through the fast
path and through Ray's ``iter_jax_batches`` (``fast_path=False``), compares every array
bit for bit with its dtype, shape, weak type, sharding and the data on each device, and
the errors, and prints one ``RAYTPU_CASE <json>`` line per case with the differences found.

This module imports neither JAX nor Ray at import time: the test reads :data:`CASES`.
"""

from __future__ import annotations

import itertools
import json
import os
import traceback
from typing import Any

DEVICES = 4
BATCH_SIZE = 8
NUMERIC_ROWS = 30  # 3 full batches of 8 + 6 rows: 6 does not divide over 4 devices
TEXT_ROWS = 28  # 3 full batches of 8 + 4 rows: 4 does
SCALARS = [f"s{i}" for i in range(6)]  # small float32 columns: stacked into one transfer
# The numeric dataset: every kind of column the fast path treats differently.
NUMERIC = ["vec", *SCALARS, "n0", "n1", "f64", "i64", "flag", "big", "tokens"]
TEXT_COLUMNS = ["vec", "s0", "s1", "tokens", "big"]  # selected from the dataset that also has a text column

TENSORS = [name for name in NUMERIC if name != "tokens"]  # Arrow blocks the fast path converts once and slices

# (name, dataset, policy, dtypes, columns): "numeric" has a list column (its blocks take Ray's batcher),
# "tensors" only sliceable columns, in two blocks, "text" needs `columns`.
DTYPES = ("none", "one", "dict")
DATASETS = {"numeric": False, "tensors": False, "text": True}  # dataset -> select TEXT_COLUMNS
CASES: list[tuple[str, str, str, str, bool]] = [
    (f"{policy}-dtypes_{dtypes}-{dataset}", dataset, policy, dtypes, DATASETS[dataset])
    for policy, dtypes, dataset in itertools.product(("drop", "pad", "raise"), DTYPES, DATASETS)
] + [("pad-dtypes_dict_missing_a_column-numeric", "numeric", "pad", "dict_missing", False)]


def _row(i: int) -> dict[str, Any]:
    import numpy as np

    row: dict[str, Any] = {
        "vec": np.array([i, -i, i / 3], np.float32),
        **{name: np.float32(i * 10 + k + 0.25) for k, name in enumerate(SCALARS)},
        "n0": np.int32(i), "n1": np.int32(-7 * i),  # a stacked int32 pair
        "f64": i / 7,  # float64: JAX makes it float32 (x64 off), so it is never stacked
        "i64": 2**40 + i,  # int64 -> int32 (wraps identically on both paths)
        "flag": i % 3 == 0,
        "big": np.full(1024 * 2, i + 0.5, np.float32),  # 64 KiB per batch of 8: above the stacking limit
        "tokens": [i, i + 1, i + 2, i + 3],  # a list column: an object array, stacked by the collate
    }
    return row


def _dtypes(kind: str, columns: list[str]) -> Any:
    import jax.numpy as jnp

    if kind == "none":
        return None
    if kind == "one":
        return jnp.bfloat16
    per_column = {name: [jnp.bfloat16, jnp.float32, jnp.float16, jnp.int8][k % 4] for k, name in enumerate(columns)}
    if kind == "dict_missing":
        per_column.pop(columns[1])
    return per_column


def _run(data: Any, policy: str, dtypes: Any, columns: list[str] | None, fast: bool) -> tuple[list, Any]:
    from airflow_provider_raytpu.workloads.batches import iter_batches

    batches: list[dict[str, Any]] = []
    try:
        for batch in iter_batches(data, BATCH_SIZE, policy, dtypes=dtypes, columns=columns, pad_value=-1,
                                  fast_path=fast):
            batches.append(batch)
    except Exception as error:  # noqa: BLE001  compared between the paths
        return batches, error
    return batches, None


def _compare_arrays(where: str, fast: Any, ray_: Any) -> list[str]:
    import numpy as np
    from jax.sharding import PartitionSpec

    problems = []
    for attr in ("shape", "dtype", "weak_type", "sharding"):
        if getattr(fast, attr) != getattr(ray_, attr):
            problems.append(f"{where}: {attr} {getattr(fast, attr)} != {getattr(ray_, attr)}")
    if len(fast.sharding.device_set) != DEVICES or fast.sharding.spec != PartitionSpec("data"):
        problems.append(f"{where}: sharding {fast.sharding} is not over {DEVICES} devices by rows")
    if np.asarray(fast).tobytes() != np.asarray(ray_).tobytes():
        problems.append(f"{where}: values differ: {np.asarray(fast)!r} != {np.asarray(ray_)!r}")
    shards = {s.device: (s.index, np.asarray(s.data).tobytes()) for s in fast.addressable_shards}
    if shards != {s.device: (s.index, np.asarray(s.data).tobytes()) for s in ray_.addressable_shards}:
        problems.append(f"{where}: the rows on each device differ")
    if [s.data.shape[0] for s in fast.addressable_shards] != [fast.shape[0] // DEVICES] * DEVICES:
        problems.append(f"{where}: rows are not split evenly over the devices")
    return problems


def compare(case: tuple[str, str, str, str, bool], datasets: dict[str, Any], calls: list[str]) -> dict[str, Any]:
    name, dataset, policy, dtypes_kind, with_columns = case
    columns = TEXT_COLUMNS if with_columns else None
    dtypes = _dtypes(dtypes_kind, columns or (TENSORS if dataset == "tensors" else NUMERIC))
    calls.clear()
    fast, fast_error = _run(datasets[dataset], policy, dtypes, columns, fast=True)
    fast_calls = list(calls)
    calls.clear()
    ray_batches, ray_error = _run(datasets[dataset], policy, dtypes, columns, fast=False)
    problems = []
    # The fast path must not hand a batch to Ray's converter - except one that Ray must refuse.
    allowed = ["_convert_batch"] if dtypes_kind == "dict_missing" else []
    if [c for c in fast_calls if c != "next_batch"] != allowed or "iter_jax_batches" not in calls:
        problems.append(f"Ray's functions the fast path called: {fast_calls}; Ray's path: {sorted(set(calls))}")
    # Only the batches that span two blocks (or are short) go through Ray's batcher.
    batched, made = fast_calls.count("next_batch"), len(fast) + (policy == "raise")  # + the short batch refused
    if dataset == "tensors" and not 0 < batched < made:
        problems.append(f"Ray's batcher made {batched} of {made} batches from sliceable blocks")
    if dataset != "tensors" and batched < made:
        problems.append(f"Ray's batcher made {batched} of {made} batches, though the blocks have a list column")
    if len(fast) != len(ray_batches):
        problems.append(f"{len(fast)} batches on the fast path, {len(ray_batches)} on Ray's")
    for index, (f, r) in enumerate(zip(fast, ray_batches, strict=False)):
        if list(f) != list(r):
            problems.append(f"batch {index}: columns {list(f)} != {list(r)}")
            continue
        for column in f:
            problems += _compare_arrays(f"batch {index} {column!r}", f[column], r[column])
    if (fast_error is None) != (ray_error is None):
        problems.append(f"errors differ: fast {fast_error!r}, Ray's {ray_error!r}")
    elif fast_error is not None and not (
        type(fast_error) is type(ray_error)
        or (isinstance(ray_error, ValueError) and isinstance(fast_error, ValueError))
    ):
        problems.append(f"errors differ: fast {type(fast_error).__name__}, Ray's {type(ray_error).__name__}")
    return {
        "case": name, "problems": problems[:10] + ([f"... {len(problems) - 10} more"] if len(problems) > 10 else []),
        "batches": len(fast), "arrays": sum(len(b) for b in fast),
        "columns": list(fast[0]) if fast else [], "dtypes": sorted({str(a.dtype) for b in fast for a in b.values()}),
        "fast_error": type(fast_error).__name__ if fast_error else None, "fast_message": str(fast_error or ""),
        "ray_error": type(ray_error).__name__ if ray_error else None,
    }


def main() -> None:
    import jax
    import ray
    import ray.data

    if jax.local_device_count() != DEVICES:
        raise SystemExit(f"expected {DEVICES} JAX devices (XLA_FLAGS), found {jax.local_device_count()}")
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        calls: list[str] = []
        import ray.data.util.jax_util as ray_jax

        one_by_one = ray_jax._convert_batch

        def counted_convert(*args: Any, **kwargs: Any) -> Any:
            calls.append("_convert_batch")
            return one_by_one(*args, **kwargs)

        ray_jax._convert_batch = counted_convert  # Ray's path looks it up at call time: counted there too
        from ray.data._internal.batcher import Batcher

        next_batch = Batcher.next_batch

        def counted_next_batch(self: Any) -> Any:
            if self._batch_size is not None:  # not the whole-block batcher under iter_batches(batch_size=None)
                calls.append("next_batch")
            return next_batch(self)

        Batcher.next_batch = counted_next_batch
        for owner in (ray.data.Dataset, ray.data.DataIterator):
            original = owner.iter_jax_batches

            def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                calls.append("iter_jax_batches")
                return _original(self, *args, **kwargs)

            owner.iter_jax_batches = counted
        numeric = ray.data.from_items([_row(i) for i in range(NUMERIC_ROWS)]).repartition(2).materialize()
        text = ray.data.from_items([{**_row(i), "text": f"row {i}"} for i in range(TEXT_ROWS)]).materialize()
        # Blocks of 6 and 24 rows: batch 0 spans both, batches 1 and 2 are cut from the second block.
        rows = [{k: v for k, v in _row(i).items() if k in TENSORS} for i in range(NUMERIC_ROWS)]
        blocks = [ray.get(ray.data.from_items(rows[a:b]).repartition(1).to_arrow_refs()[0])
                  for a, b in ((0, 6), (6, NUMERIC_ROWS))]
        tensors = ray.data.from_arrow(blocks).materialize()
        datasets = {"numeric": numeric, "tensors": tensors, "text": text}
        for case in CASES:
            try:
                result = compare(case, datasets, calls)
            except Exception:  # noqa: BLE001  reported to the test as this case's problem
                result = {"case": case[0], "problems": [traceback.format_exc()]}
            print("RAYTPU_CASE " + json.dumps(result), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
