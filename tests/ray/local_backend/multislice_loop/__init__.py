"""The example train loop, recording what each worker of a multi-slice run sees.

Shipped to the workers as a ``py_modules`` package next to ``pipeline``. At the first step a
worker runs (step 1, or the step after the checkpoint it resumed from), it writes
``<marker_dir>/rank<rank>-step<step>.json``: its world rank and size, its slice (the node's
``ray.io/tpu-slice-name`` label), the ``MEGASCALE_*`` environment Ray Train set for it and the one
its host (the raylet, started with the pod's environment) has and the address the host's coordinator
name resolves to, the worker's node address, the ids of the rows in its shard of
the ``shard_dataset`` dataset, and the time. Rank 0 also appends every step it finishes, and when,
to ``<marker_dir>/progress.jsonl``. With ``step_seconds`` in the config, every step takes that much
longer. The test runs on the same machine and reads the files.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from pipeline.train_loop import train


def _megascale(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith("MEGASCALE_")}


def _host_environ() -> dict[str, str]:
    """The environment of this worker's raylet (its parent process), as the host started it."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _resolve(name: str | None) -> str | None:
    try:
        return socket.gethostbyname(name) if name else None
    except OSError:
        return None


def _record(config: dict[str, Any], marker_dir: Path, step: int, rank: int) -> None:
    import ray
    import ray.train

    context = ray.train.get_context()
    node = ray.get_runtime_context().get_node_id()
    labels = next(n.get("Labels") or {} for n in ray.nodes() if n["NodeID"] == node)
    shard = ray.train.get_dataset_shard(config["shard_dataset"])
    host = _megascale(_host_environ())
    record = {
        "rank": rank,
        "world_size": context.get_world_size(),
        "step": step,
        "slice": labels.get("ray.io/tpu-slice-name"),
        "megascale": _megascale(dict(os.environ)),
        "host_megascale": host,
        "host_coordinator_ip": _resolve(host.get("MEGASCALE_COORDINATOR_ADDRESS")),
        "node_ip": ray.util.get_node_ip_address(),
        "ids": sorted(int(row["id"]) for row in shard.iter_rows()),
        "time": time.time(),
    }
    (marker_dir / f"rank{rank}-step{step}.json").write_text(json.dumps(record))


def record_first_step(config: dict[str, Any]) -> Any:
    """An ``after_step`` hook writing the records described above (the first-step one once per worker process)."""
    marker_dir = Path(config["marker_dir"])
    done: list[int] = []

    def after_step(step: int, rank: int) -> None:
        time.sleep(float(config.get("step_seconds") or 0))  # a step as long as a real one
        if not done:
            done.append(step)
            _record(config, marker_dir, step, rank)
        if rank == 0:
            with open(marker_dir / "progress.jsonl", "a") as progress:
                progress.write(json.dumps({"step": step, "time": time.time()}) + "\n")

    return after_step


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The example loop with :func:`record_first_step`."""
    train(config, after_step=record_first_step(config))
