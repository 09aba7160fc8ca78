"""A tiny deterministic dataset: short texts plus numeric features and a target, as JSONL or parquet.

Run it to write one::

    python -m pipeline.data --output gs://bucket/raw/data.jsonl --rows 4000
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .model import NUM_FEATURES, target_function

VOCABULARY = (
    "tpu slice host chip ray data train serve jax flax orbax checkpoint batch step loss "
    "model token embed layer mesh shard gradient optimizer adam learning rate epoch"
).split()
# Raw features arrive scaled and shifted; the normalise transform undoes it.
RAW_SCALE = 10.0
RAW_SHIFT = 3.0


def generate_rows(num_rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num_rows`` rows of ``id``, ``text``, ``x`` (raw features, not yet normalised) and ``y``.

    :param num_rows: how many rows.
    :param seed: the generator's seed; the same seed gives the same rows.
    """
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(num_rows, NUM_FEATURES)).astype(np.float32)
    targets = target_function(features)
    raw = features * RAW_SCALE + RAW_SHIFT
    rows = []
    for index in range(num_rows):
        words = rng.choice(VOCABULARY, size=int(rng.integers(3, 12)))
        text = " ".join(w.upper() if rng.random() < 0.2 else w for w in words)
        rows.append({"id": index, "text": text, "x": raw[index].tolist(), "y": float(targets[index])})
    return rows


def write_dataset(uri: str, num_rows: int, seed: int = 0, fmt: str = "jsonl") -> str:
    """Write the dataset to ``uri`` (one JSONL file, or one parquet file) and return the URI.

    :param uri: ``gs://bucket/path.jsonl`` or a local path.
    :param num_rows: how many rows.
    :param seed: the generator's seed.
    :param fmt: ``"jsonl"`` or ``"parquet"``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_raytpu.workloads.storage import resolve

    location = resolve(uri)
    rows = generate_rows(num_rows, seed)
    parent = location.path.rsplit("/", 1)[0]
    location.filesystem.create_dir(parent, recursive=True)
    if fmt == "jsonl":
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        with location.filesystem.open_output_stream(location.path) as stream:
            stream.write(data)
    elif fmt == "parquet":
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        with location.filesystem.open_output_stream(location.path) as stream:
            stream.write(buffer.getvalue())
    else:
        raise ValueError(f"fmt={fmt!r} is not 'jsonl' or 'parquet'")
    return location.uri


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)
    print(write_dataset(args.output, args.rows, args.seed, args.format))


if __name__ == "__main__":
    main()
