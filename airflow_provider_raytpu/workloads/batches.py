"""JAX batches from a Ray Data shard with an explicit policy for the ragged final batch.

Ray Train splits a dataset equally between workers (``streaming_split(equal=True)``),
so each worker gets ``num_rows // num_workers`` rows; unless that is a multiple of the
batch size, every worker's last batch is short. A jitted step recompiles for the new
shape at best, and on a multi-host slice the hosts can disagree. Pick one of:

- ``"drop"``: skip the short batch (``drop_last``); a few rows go unseen each epoch.
- ``"pad"``: pad the short batch to full size and add a boolean ``mask`` column, True
  for real rows, so padded rows can be left out of the loss (``loss * mask``).
- ``"raise"``: refuse. :func:`check_batches` runs on the driver before ``fit()`` and
  fails at once with the numbers and the fix, instead of hours later in a worker.

``batch_size`` is per worker (per host), as in ``iter_jax_batches``; the global batch is
``batch_size * num_workers``.

This module imports neither Ray nor JAX at import time; the training driver uses
:func:`check_batches` without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

RaggedPolicy = Literal["drop", "pad", "raise"]
POLICIES: tuple[str, ...] = ("drop", "pad", "raise")
MASK_COLUMN = "mask"


class RaggedBatchError(ValueError):
    """The data does not divide into full batches and the policy is ``"raise"``."""


@dataclass(frozen=True)
class BatchPlan:
    """How a dataset splits into per-worker batches.

    :param num_rows: rows in the dataset.
    :param batch_size: rows per batch on each worker.
    :param num_workers: training workers (hosts) the dataset is split between.
    :param policy: the ragged-batch policy.
    """

    num_rows: int
    batch_size: int
    num_workers: int
    policy: str

    @property
    def rows_per_worker(self) -> int:
        """Rows each worker receives (Ray splits equally and drops the remainder)."""
        return self.num_rows // self.num_workers

    @property
    def rows_left_out_by_split(self) -> int:
        return self.num_rows % self.num_workers

    @property
    def full_batches(self) -> int:
        return self.rows_per_worker // self.batch_size

    @property
    def ragged_rows(self) -> int:
        """Rows in each worker's short last batch (0 if there is none)."""
        return self.rows_per_worker % self.batch_size

    @property
    def is_ragged(self) -> bool:
        """Whether any row would be dropped by the split or land in a short batch."""
        return self.num_rows % (self.batch_size * self.num_workers) != 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches each worker yields per epoch under the policy."""
        return self.full_batches + (1 if self.ragged_rows and self.policy == "pad" else 0)

    @property
    def rows_used_per_epoch(self) -> int:
        """Real (unpadded) rows all workers together train on per epoch."""
        per_worker = self.rows_per_worker if self.policy == "pad" else self.full_batches * self.batch_size
        return per_worker * self.num_workers


def _divisors_near(value: int, target: int, count: int = 3) -> list[int]:
    small = [d for d in range(1, int(value**0.5) + 1) if value % d == 0]
    divisors = set(small) | {value // d for d in small}
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), -d))[:count])


def _ragged_message(plan: BatchPlan) -> str:
    global_batch = plan.batch_size * plan.num_workers
    lines = [
        f"{plan.num_rows} rows do not split into full batches: batch_size={plan.batch_size} per worker "
        f"x {plan.num_workers} workers = {global_batch} rows per step, and {plan.num_rows} is not a "
        f"multiple of {global_batch}."
    ]
    if plan.rows_left_out_by_split:
        lines.append(
            f"Ray gives each worker {plan.rows_per_worker} rows and leaves out "
            f"{plan.rows_left_out_by_split} (the split is equal)."
        )
    if plan.ragged_rows:
        lines.append(
            f"Each worker's last batch would hold {plan.ragged_rows} rows instead of {plan.batch_size}."
        )
    fixes = [
        "set ragged_policy='drop' (skip the short batch) or 'pad' (pad it and mask the padded rows)",
        f"or give a dataset of {plan.num_rows - plan.num_rows % global_batch} or "
        f"{plan.num_rows - plan.num_rows % global_batch + global_batch} rows",
    ]
    if plan.rows_per_worker and not plan.rows_left_out_by_split:
        sizes = ", ".join(map(str, _divisors_near(plan.rows_per_worker, plan.batch_size)))
        fixes.append(f"or a batch_size that divides {plan.rows_per_worker}, such as {sizes}")
    lines.append("To fix it, " + ", ".join(fixes) + ".")
    return " ".join(lines)


def check_batches(num_rows: int, batch_size: int, num_workers: int, policy: str) -> BatchPlan:
    """Check, on the driver and before ``fit()``, how the data will batch; fail early under ``"raise"``.

    :param num_rows: rows in the dataset (``Dataset.count()``).
    :param batch_size: rows per batch on each worker.
    :param num_workers: training workers the dataset is split between.
    :param policy: ``"drop"``, ``"pad"`` or ``"raise"``.
    :raises RaggedBatchError: under ``"raise"`` when the rows do not split into full batches.
    :raises ValueError: for a bad policy or non-positive numbers, or when no worker would
        get a single full batch under ``"drop"``.
    """
    if policy not in POLICIES:
        raise ValueError(f"ragged_policy={policy!r} is not one of {', '.join(POLICIES)}")
    for name, value in (("batch_size", batch_size), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number of at least 1")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows={num_rows!r} must be a whole number of at least 0")
    plan = BatchPlan(num_rows, batch_size, num_workers, policy)
    if policy == "raise" and plan.is_ragged:
        raise RaggedBatchError(_ragged_message(plan))
    if policy == "drop" and plan.full_batches == 0:
        raise ValueError(
            f"{num_rows} rows over {num_workers} workers is {plan.rows_per_worker} rows per worker, "
            f"fewer than batch_size={batch_size}: with ragged_policy='drop' no batch would be left. "
            "Use a smaller batch_size or ragged_policy='pad'."
        )
    return plan


def _collate(
    batch: dict[str, Any], batch_size: int, pad: bool, pad_value: float, columns: list[str] | None
) -> dict[str, Any]:
    """Keep ``columns``, stack list columns, and under "pad" pad a short batch and add the mask column.

    :param batch: one numpy batch from Ray Data (column name -> array).
    :param batch_size: rows per batch on this worker (the size a short batch is padded to).
    :param pad: whether the policy is ``"pad"``.
    :param pad_value: the value of padded rows in the data columns.
    :param columns: the columns to keep, in this order (all when None).
    """
    import numpy as np

    if pad and MASK_COLUMN in batch and (columns is None or MASK_COLUMN in columns):
        raise ValueError(
            f"the dataset already has a {MASK_COLUMN!r} column; drop or rename it to use ragged_policy='pad'"
        )
    if columns is not None:
        missing = [c for c in columns if c not in batch]
        if missing:
            raise KeyError(f"columns {missing} are not in the dataset (it has {sorted(batch)})")
        batch = {c: batch[c] for c in columns}
    out: dict[str, Any] = {}
    rows = 0
    for name, column in batch.items():
        if column.dtype == object:  # a list column read back from parquet
            column = np.stack(list(column))
        rows = len(column)
        short = batch_size - rows
        if pad and short > 0:
            padding = np.full((short,) + column.shape[1:], pad_value, dtype=column.dtype)
            column = np.concatenate([column, padding])
        out[name] = column
    if pad:
        out[MASK_COLUMN] = np.arange(batch_size) < rows
    return out


def _collate_fn(batch_size: int, pad: bool, pad_value: float, columns: list[str] | None) -> Any:
    """:func:`_collate` as the collate function Ray's ``iter_jax_batches`` takes."""
    from ray.data.collate_fn import NumpyBatchCollateFn

    class SelectPadMask(NumpyBatchCollateFn):
        # Ray declares the result as a TypeVar bound to nothing (ray.data.dataset.CollatedData): any type is right.
        def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
            return _collate(batch, batch_size, pad, pad_value, columns)

    return SelectPadMask()


def _effective_dtypes(policy: str, dtypes: Any, columns: list[str] | None) -> Any:
    """The ``dtypes`` the arrays are made with: under "pad" the mask stays boolean unless one dtype casts all."""
    if policy == "pad":
        if isinstance(dtypes, dict):
            return {**dtypes, MASK_COLUMN: bool}
        if dtypes is not None and columns is not None:
            return {**{c: dtypes for c in columns}, MASK_COLUMN: bool}
    return dtypes


def _short_batch_error(index: int, rows: int, batch_size: int, processes: int) -> RaggedBatchError:
    return RaggedBatchError(
        f"batch {index} has {rows} rows per worker, not batch_size={batch_size} "
        f"({processes} workers): the data does not split into full batches and "
        "ragged_policy='raise'. Use 'drop' or 'pad', or resize the dataset; "
        "check_batches() on the driver catches this before training starts."
    )


def iter_batches(
    data: Any,
    batch_size: int,
    policy: str,
    *,
    dtypes: Any = None,
    prefetch_batches: int = 1,
    pad_value: float = 0,
    columns: list[str] | None = None,
    synchronize: bool | None = None,
    fast_path: bool = True,
) -> Iterator[Any]:
    """Iterate a Ray Data shard as global JAX batches, handling the short last batch by ``policy``.

    The arrays are those of Ray's ``iter_jax_batches`` (sharded over Ray's 1-D ``data``
    mesh of all devices). On a single JAX process they are made by a faster path with the
    same output (see :mod:`.batch_transfer`); with several processes (a multi-host slice)
    Ray's own path runs, whose ``synchronize`` step agrees batch counts across hosts.

    :param data: a ``DataIterator`` (``ray.train.get_dataset_shard(name)``) or a ``Dataset``.
    :param batch_size: rows per batch on this worker.
    :param policy: ``"drop"``, ``"pad"`` (adds a boolean ``mask`` column, padded rows
        False) or ``"raise"`` (a short batch raises :class:`RaggedBatchError`).
    :param dtypes: JAX dtype(s) for the arrays, as in ``iter_jax_batches``. The mask
        stays boolean with a per-column dict, or a single dtype plus ``columns``; a single
        dtype without ``columns`` casts the mask too (1 / 0, still usable as a weight).
    :param prefetch_batches: batches to fetch ahead.
    :param pad_value: the value padded rows hold in the data columns under ``"pad"``.
    :param columns: the columns to turn into arrays (all by default; text columns
        cannot become JAX arrays, so name the numeric ones).
    :param synchronize: agree batch counts and shapes across hosts (needed when hosts'
        shards can differ); by default on whenever there is more than one JAX process.
    :param fast_path: False always uses Ray's ``iter_jax_batches`` (same arrays, slower).
    """
    if policy not in POLICIES:
        raise ValueError(f"ragged_policy={policy!r} is not one of {', '.join(POLICIES)}")
    import jax

    from airflow_provider_raytpu.workloads import block_batches
    from airflow_provider_raytpu.workloads.batch_transfer import ray_conversion

    processes = jax.process_count()
    conversion = ray_conversion() if fast_path and processes == 1 and block_batches.available() else None
    effective = _effective_dtypes(policy, dtypes, columns)
    if conversion is not None:
        yield from _fast_batches(data, batch_size, policy, effective, prefetch_batches, pad_value, columns, conversion)
        return
    sync = processes > 1 if synchronize is None else synchronize
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "dtypes": effective,
        "prefetch_batches": prefetch_batches,
        "synchronize_batches": sync,
        "collate_fn": _collate_fn(batch_size, policy == "pad", pad_value, columns),
    }
    if policy == "drop":
        yield from data.iter_jax_batches(drop_last=True, **options)
        return
    if policy == "pad":
        # Our collate pads each short batch (mask False); Ray's paddings only fill whole
        # dummy batches for a host that ran out early, where 0 makes the mask False too.
        yield from data.iter_jax_batches(paddings=0, **options)
        return
    expected = batch_size * processes
    for index, batch in enumerate(data.iter_jax_batches(drop_last=False, **options)):
        arrays = batch.values() if isinstance(batch, dict) else [batch]
        rows = next(iter(arrays)).shape[0]
        if rows != expected:
            raise _short_batch_error(index, rows // processes, batch_size, processes)
        yield batch


def _fast_batches(
    data: Any,
    batch_size: int,
    policy: str,
    dtypes: Any,
    prefetch_batches: int,
    pad_value: float,
    columns: list[str] | None,
    conversion: tuple[Any, Any],
) -> Iterator[dict[str, Any]]:
    """One JAX process: Ray Data's numpy batches (:mod:`.block_batches`), our collate, then :class:`.BatchTransfer`.

    Mirrors Ray's single-process path (``ray/data/iterator.py`` ``iter_jax_batches`` and
    ``ray/data/util/jax_util.py`` ``_yield_batches_no_sync``), where ``synchronize`` has
    no effect either.
    """
    import jax

    from airflow_provider_raytpu.workloads.batch_transfer import BatchTransfer
    from airflow_provider_raytpu.workloads.block_batches import numpy_batches

    devices = jax.local_device_count()
    if batch_size <= 0 or batch_size % devices != 0:  # Ray's check and message (iterator.py)
        raise ValueError(
            f"The provided batch_size ({batch_size}) must be a positive integer "
            f"evenly divisible by the number of local JAX devices ({devices}) on this host."
        )
    make_sharding, one_by_one = conversion
    transfer = BatchTransfer(make_sharding(), dtypes, one_by_one)
    pad = policy == "pad"
    index = 0
    for numpy_batch in numpy_batches(data, batch_size, policy == "drop", prefetch_batches):
        batch = _collate(numpy_batch, batch_size, pad, pad_value, columns)
        rows = len(next(iter(batch.values()))) if batch else 0
        if rows == 0:  # Ray skips empty batches (_yield_batches_no_sync)
            continue
        if rows != batch_size:  # only "raise" sees a short batch here
            raise _short_batch_error(index, rows, batch_size, 1)
        yield transfer(batch)
        index += 1
