"""The rows a preprocessing job read and wrote, counted in the one pass that transforms and writes.

Neither the input nor the output is read again to count it. The rows written are Ray's own figure:
``Dataset.write_datasink`` hands the datasink a ``WriteResult`` with ``num_rows`` (Ray 2.60
``data/dataset.py``), which :class:`CountingParquetSink` keeps. The rows read are counted by a step
just before the transform (:func:`count_rows`): it sees each block whole, zero-copy, and hands it on
unchanged. It keeps the running count of its Ray Data task in the task's ``TaskContext.kwargs``.
How that count reaches the driver depends on where the transform runs:

- A function without a concurrency cap runs in one task with the counting step and the write: Ray
  Data fuses ``map_batches`` steps and the write that have the same remote arguments and compute
  (``logical/rules/operator_fusion.py``: ``_can_fuse``, ``are_remote_args_compatible``,
  ``_fuse_compute_strategy``), and the job gives all three the transform's. The datasink's ``write``
  returns the task's count; Ray collects each write task's return into the ``WriteResult``
  (``planner/plan_write_op.py``). A retried task runs with a fresh context: only the attempts Ray
  keeps are summed. No process is added.
- A class runs in an actor pool, which Ray never fuses with the task that writes (actor to task), and
  a capped function is kept apart from its write (see ``preprocess.counted_in_one_task``). The
  counting step is fused into the transform's task or actor. It reports the task's running count to
  a :class:`RowTally` actor after each block and waits for the answer, so every count is in before
  the write ends. An entry is set, not added to: a retried task, which keeps its task index, replaces
  what its failed attempt reported.

Where neither holds (a write task that ran no counting step), :func:`rows_read` answers ``None`` and
the job counts its input again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.data.datasource.datasink import WriteResult

from airflow_provider_raytpu.workloads.ray_compat import ParquetDatasink, TaskContext

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data.block import Block

ROWS_READ = "raytpu_rows_read"


def count_rows(batch: pa.Table, tally: Any = None) -> pa.Table:
    """A ``map_batches`` step: add ``batch``'s rows to its task's count (and report it to ``tally``); the batch."""
    context = TaskContext.get_current()
    if context is None:  # Ray Data runs a function step in the task's own thread, which has one
        raise RuntimeError("count_rows runs as a Ray Data map_batches step")
    context.kwargs[ROWS_READ] = context.kwargs.get(ROWS_READ, 0) + batch.num_rows
    if tally is not None:
        ray.get(tally.record.remote((context.op_name, context.task_idx), context.kwargs[ROWS_READ]))
    return batch


def counted(dataset: Any, tally: Any = None, **map_args: Any) -> Any:
    """``dataset`` with a :func:`count_rows` step after it.

    :param dataset: a ``ray.data.Dataset``.
    :param tally: the :class:`RowTally` to report to (``None``: the write returns the count).
    :param map_args: the transform's remote arguments and compute (so that the step fuses with it).
    """
    return dataset.map_batches(count_rows, fn_kwargs={"tally": tally}, batch_size=None, batch_format="pyarrow",
                               zero_copy_batch=True, **map_args)


class RowTally:
    """The running count of rows read by each task of the transform (a Ray actor: :func:`start_tally`)."""

    def __init__(self) -> None:
        self.rows: dict[Any, int] = {}

    def record(self, task: Any, rows: int) -> None:
        self.rows[task] = rows

    def total(self) -> int:
        return sum(self.rows.values())


def start_tally() -> Any:
    """A :class:`RowTally` actor. It takes no CPU, so it never waits for the transform's resources."""
    return ray.remote(num_cpus=0)(RowTally).remote()


class CountingParquetSink(ParquetDatasink):
    """Ray's parquet datasink (what ``Dataset.write_parquet`` uses), returning from each write the rows its task
    read (``None`` when no counting step ran in it), and keeping the :class:`WriteResult` as ``written``."""

    written: WriteResult[int | None] | None = None

    # Ray's file datasinks are Datasink[None], but Ray collects whatever write returns into the WriteResult.
    def write(self, blocks: Iterable[Block], ctx: TaskContext) -> int | None:  # type: ignore[override]
        super().write(blocks, ctx)  # consuming the blocks runs the steps fused before the write
        return ctx.kwargs.get(ROWS_READ)

    def on_write_complete(self, write_result: WriteResult[None]) -> None:
        super().on_write_complete(write_result)
        self.written = cast("WriteResult[int | None]", write_result)  # its write_returns are what write returned


def rows_read(written: WriteResult[int | None], tally: Any = None) -> int | None:
    """The rows the job read in the pass that wrote ``written``; ``None`` when they were not all counted.

    :param written: what the write reported.
    :param tally: the :class:`RowTally` the counting step reported to, if any.
    """
    if tally is not None:
        return int(ray.get(tally.total.remote()))
    counts = [int(rows) for rows in written.write_returns if rows is not None]
    return sum(counts) if len(counts) == len(written.write_returns) else None
