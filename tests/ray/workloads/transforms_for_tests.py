"""Transforms that record where they ran, to test how the preprocessing job schedules them."""

from __future__ import annotations

import os
import uuid

import numpy as np


def double_y(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stateless: keep ``id`` and add ``y2 = 2 * y``, plus the worker's pid."""
    return {
        "id": np.asarray(batch["id"]),
        "y2": np.asarray(batch["y"], dtype=np.float64) * 2,
        "pid": np.full(len(batch["id"]), os.getpid()),
    }


class WhereAmI:
    """Stateful: an instance id made once in ``__init__``, plus the Ray node and TPU host it runs on.

    :param tag: a constructor argument, echoed back to prove ``--transform-kwargs`` reach ``__init__``.
    """

    def __init__(self, tag: str = "") -> None:
        import ray

        self.instance = uuid.uuid4().hex
        self.node_id = ray.get_runtime_context().get_node_id()
        self.tpu_worker_id = os.environ.get("TPU_WORKER_ID", "")
        self.tag = tag

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(batch["id"])
        return {
            "id": np.asarray(batch["id"]),
            "instance": np.asarray([self.instance] * rows, dtype=object),
            "node_id": np.asarray([self.node_id] * rows, dtype=object),
            "tpu_worker_id": np.asarray([self.tpu_worker_id] * rows, dtype=object),
            "tag": np.asarray([self.tag] * rows, dtype=object),
        }


def even_ids(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stateless: only the rows with an even ``id``."""
    keep = np.asarray(batch["id"]) % 2 == 0
    return {"id": np.asarray(batch["id"])[keep], "y": np.asarray(batch["y"])[keep]}


class EvenIds:
    """Stateful :func:`even_ids` (an actor pool)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return even_ids(batch)


def crash_once(batch: dict[str, np.ndarray], marker: str) -> dict[str, np.ndarray]:
    """Kill the worker process at the first batch it is ever given (``marker`` not there yet), as a lost host
    would; Ray then runs the task again."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return {"id": np.asarray(batch["id"])}
