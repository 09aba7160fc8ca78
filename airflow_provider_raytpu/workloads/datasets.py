"""Read datasets from, and write them to, storage URIs through the storage seam (Ray Data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.outputs import replace_output
from airflow_provider_raytpu.workloads.storage import Location, resolve

if TYPE_CHECKING:
    import ray.data
    from ray.data.datasource.datasink import WriteResult

FORMATS = ("parquet", "jsonl")


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


def write_parquet_replacing(dataset: ray.data.Dataset, uri: str, owner: str = "",
                            **write_args: Any) -> tuple[Location, WriteResult[int | None]]:
    """Write ``dataset`` as parquet so that ``uri`` ends up holding exactly this output; where, and what the
    write reported (:class:`~airflow_provider_raytpu.workloads.row_tally.CountingParquetSink`).

    A retried or re-run job replaces the output its task wrote before instead of adding
    duplicate rows; a prefix holding anything else is refused, and a job that dies while
    writing or swapping never leaves less than one complete output
    (:func:`~airflow_provider_raytpu.workloads.outputs.replace_output`). Two jobs must not
    write the same output at once - the deterministic job submission id already ensures that.

    :param dataset: the dataset to write.
    :param uri: the output directory / prefix (not a whole bucket).
    :param owner: the task writing it; only an earlier output of the same owner is replaced.
    :param write_args: passed on to ``Dataset.write_datasink`` (``ray_remote_args``, ``concurrency``).
    :raises OutputNotOwnedError: the prefix holds files this task did not write.
    """
    from airflow_provider_raytpu.workloads.row_tally import CountingParquetSink

    sink = None

    def write(at: Location) -> None:
        nonlocal sink
        sink = CountingParquetSink(at.path, filesystem=at.filesystem)
        dataset.write_datasink(sink, **write_args)

    target = replace_output(uri, owner, write)
    assert sink is not None and sink.written is not None, "replace_output writes once, and the write reports"
    return target, sink.written
