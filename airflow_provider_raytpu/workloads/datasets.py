"""Read datasets from, and write them to, storage URIs through the storage seam (Ray Data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.storage import Location, delete_prefix, move_tree, resolve

if TYPE_CHECKING:
    import ray.data

FORMATS = ("parquet", "jsonl")
TEMP_SUFFIX = ".raytpu-tmp"


def detect_format(uri: str) -> str:
    """Guess a dataset's format from its URI: ``.jsonl``/``.json`` (optionally compressed) is JSONL, else parquet.

    :param uri: the dataset URI (a file or a directory / prefix).
    """
    name = uri.rstrip("/").lower()
    for suffix in (".gz", ".zst", ".br", ".lz4"):
        name = name.removesuffix(suffix)
    return "jsonl" if name.endswith((".jsonl", ".json")) else "parquet"


def read_dataset(uri: str, fmt: str | None = None, **read_args: Any) -> ray.data.Dataset:
    """Read parquet or JSONL at ``uri`` (a file or a directory / prefix) as a Ray Dataset.

    :param uri: ``gs://bucket/prefix``, a local path or ``file://`` URI.
    :param fmt: ``"parquet"`` or ``"jsonl"``; guessed from the URI when ``None``.
    :param read_args: passed on to ``ray.data.read_parquet`` / ``read_json``.
    """
    import ray.data

    fmt = fmt or detect_format(uri)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    location = resolve(uri)
    if location.filesystem.get_file_info(location.path).type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"no dataset at {location.uri}")
    if fmt == "parquet":
        return ray.data.read_parquet(location.path, filesystem=location.filesystem, **read_args)
    # pyarrow's JSON reader (lines=False) reads newline-delimited JSON; Ray 2.60's
    # lines=True reader (pandas) refuses an explicit filesystem, so it cannot reach GCS here.
    return ray.data.read_json(location.path, filesystem=location.filesystem, **read_args)


def write_parquet_replacing(dataset: ray.data.Dataset, uri: str, **write_args: Any) -> Location:
    """Write ``dataset`` as parquet so that ``uri`` ends up holding exactly this output.

    The files are written to a temporary sibling prefix (``<uri>.raytpu-tmp``) first;
    only when every write task has finished is the old output deleted and the new
    files moved into place. A retried or re-run job therefore replaces the output
    instead of adding duplicate rows, and a job that dies while writing leaves the
    previous output untouched; the next attempt clears the temporary prefix first.
    The temporary name is fixed, not random, so a retry finds what a crashed attempt
    left (pyarrow cannot list GCS "directories" non-recursively to search for it).
    Two jobs must not write the same output at once - the deterministic job
    submission id already ensures that.

    :param dataset: the dataset to write.
    :param uri: the output directory / prefix (not a whole bucket).
    :param write_args: passed on to ``Dataset.write_parquet``.
    """
    target = resolve(uri)
    temporary = target.sibling(target.name + TEMP_SUFFIX)
    delete_prefix(temporary.uri)  # whatever a crashed attempt left
    dataset.write_parquet(temporary.path, filesystem=target.filesystem, **write_args)
    delete_prefix(target.uri)
    if target.filesystem.get_file_info(temporary.path).type == pafs.FileType.NotFound:
        # An empty dataset writes no files; publish an empty directory.
        target.filesystem.create_dir(target.path)
        return target
    move_tree(temporary, target)
    delete_prefix(temporary.uri)
    return target
