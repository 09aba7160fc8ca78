"""The example train loop, recording what each worker of a multi-slice run sees.

Shipped to the workers as a ``py_modules`` package next to ``pipeline``. At the first step a
worker runs (step 1, or the step after the checkpoint it resumed from), it writes
``<marker_dir>/rank<rank>-step<step>.json``: its world rank and size, its slice (the node's
``ray.io/tpu-slice-name`` label), the ``MEGASCALE_*`` environment Ray Train set for it, and the
ids of the rows in its shard of the ``shard_dataset`` dataset. The test runs on the same machine
and reads the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.train_loop import train


def record_first_step(config: dict[str, Any]) -> Any:
    """An ``after_step`` hook writing the record described above, once per worker process."""
    marker_dir = Path(config["marker_dir"])
    done: list[int] = []

    def after_step(step: int, rank: int) -> None:
        if done:
            return
        done.append(step)
        import ray
        import ray.train

        context = ray.train.get_context()
        node = ray.get_runtime_context().get_node_id()
        labels = next(n.get("Labels") or {} for n in ray.nodes() if n["NodeID"] == node)
        shard = ray.train.get_dataset_shard(config["shard_dataset"])
        record = {
            "rank": rank,
            "world_size": context.get_world_size(),
            "step": step,
            "slice": labels.get("ray.io/tpu-slice-name"),
            "megascale": {k: v for k, v in os.environ.items() if k.startswith("MEGASCALE_")},
            "ids": sorted(int(row["id"]) for row in shard.iter_rows()),
        }
        (marker_dir / f"rank{rank}-step{step}.json").write_text(json.dumps(record))

    return after_step


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The example loop with :func:`record_first_step`."""
    train(config, after_step=record_first_step(config))
