"""The overlap soak's transform (shipped to the Ray cluster in the job's runtime_env): each row tagged with the
run that wrote it, slowly enough that the runs' writes overlap."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def tag_run(batch: dict[str, Any], run: str, seconds_per_batch: float = 0.5) -> dict[str, Any]:
    """``batch`` with a ``run`` column naming ``run``, after ``seconds_per_batch``."""
    time.sleep(seconds_per_batch)
    return {**batch, "run": np.full(len(next(iter(batch.values()))), run, dtype=object)}
