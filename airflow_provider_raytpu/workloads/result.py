"""How a Ray job hands its result to the Airflow task: one ``RAYTPU_RESULT <json>`` log line.

The workload prints the line (the last one wins); the operator reads the job's log
and parses it. This module imports nothing but the standard library, so the operator
can import it without Ray, JAX or Airflow being involved.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

RESULT_PREFIX = "RAYTPU_RESULT "
EXIT_BAD_INPUT = 2
"""A workload's exit code for input only its author can fix (a typo in an import path, a missing
column): the Airflow task then fails without retries. Also argparse's code for bad arguments."""


def _plain(value: Any) -> Any:
    """JSON-ready copy of ``value``: numpy/JAX scalars and arrays become numbers and lists; NaN/inf become None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy / JAX scalars and arrays
        return _plain(value.tolist())
    return str(value)


def report_result(data: dict[str, Any]) -> None:
    """Print ``data`` as the job's result line and flush stdout.

    :param data: a JSON-serialisable mapping; numpy/JAX numbers are converted, NaN
        and infinity become ``null``.
    """
    if not isinstance(data, dict):
        raise TypeError(f"a job result is a dict, got {type(data).__name__}")
    line = RESULT_PREFIX + json.dumps(_plain(data), sort_keys=True, allow_nan=False)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def last_result(log_text: str) -> dict[str, Any] | None:
    """The last well-formed result in a job's log, or ``None`` if there is none.

    A line counts when it starts with :data:`RESULT_PREFIX`, optionally after a Ray
    log prefix such as ``(RayTrainWorker pid=12) ``, and the rest is a JSON object.
    Malformed candidates (e.g. a line cut off when the job was killed) are skipped.

    :param log_text: the job's full log (stdout and stderr as Ray stores them).
    """
    for line in reversed(log_text.splitlines()):
        index = line.find(RESULT_PREFIX)
        if index < 0:
            continue
        prefix = line[:index]
        # Accept the bare line, or a Ray log prefix that ends in ") " - nothing else,
        # so a line merely *mentioning* the marker is not taken for a result.
        if prefix and not prefix.rstrip().endswith(")"):
            continue
        try:
            data = json.loads(line[index + len(RESULT_PREFIX):])
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None
