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


def _collate(batch_size: int, pad: bool, pad_value: float, columns: list[str] | None) -> Any:
    """A Ray Data collate function: keep ``columns``, stack list columns, and under "pad" pad and mask."""
    import numpy as np
    from ray.data.collate_fn import NumpyBatchCollateFn

    class SelectPadMask(NumpyBatchCollateFn):
        def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if pad and MASK_COLUMN in batch and (columns is None or MASK_COLUMN in columns):
                raise ValueError(
                    f"the dataset already has a {MASK_COLUMN!r} column; drop or rename it to use ragged_policy='pad'"
                )
            if columns is not None:
                missing = [c for c in columns if c not in batch]
                if missing:
                    raise KeyError(f"columns {missing} are not in the dataset (it has {sorted(batch)})")
                batch = {c: batch[c] for c in columns}
            out: dict[str, np.ndarray] = {}
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

    return SelectPadMask()


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
) -> Iterator[Any]:
    """Iterate a Ray Data shard as global JAX batches, handling the short last batch by ``policy``.

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
    """
    if policy not in POLICIES:
        raise ValueError(f"ragged_policy={policy!r} is not one of {', '.join(POLICIES)}")
    import jax

    processes = jax.process_count()
    sync = processes > 1 if synchronize is None else synchronize
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "dtypes": dtypes,
        "prefetch_batches": prefetch_batches,
        "synchronize_batches": sync,
        "collate_fn": _collate(batch_size, policy == "pad", pad_value, columns),
    }
    if policy == "drop":
        yield from data.iter_jax_batches(drop_last=True, **options)
        return
    if policy == "pad":
        if isinstance(dtypes, dict):
            options["dtypes"] = {**dtypes, MASK_COLUMN: bool}
        elif dtypes is not None and columns is not None:
            options["dtypes"] = {**{c: dtypes for c in columns}, MASK_COLUMN: bool}
        # Our collate pads each short batch (mask False); Ray's paddings only fill whole
        # dummy batches for a host that ran out early, where 0 makes the mask False too.
        yield from data.iter_jax_batches(paddings=0, **options)
        return
    expected = batch_size * processes
    for index, batch in enumerate(data.iter_jax_batches(drop_last=False, **options)):
        arrays = batch.values() if isinstance(batch, dict) else [batch]
        rows = next(iter(arrays)).shape[0]
        if rows != expected:
            raise RaggedBatchError(
                f"batch {index} has {rows // processes} rows per worker, not batch_size={batch_size} "
                f"({processes} workers): the data does not split into full batches and "
                "ragged_policy='raise'. Use 'drop' or 'pad', or resize the dataset; "
                "check_batches() on the driver catches this before training starts."
            )
        yield batch
