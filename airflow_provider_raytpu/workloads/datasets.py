"""Read datasets from, and write them to, storage URIs through the storage seam (Ray Data)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.outputs import committed_files, replace_output
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
    """Read parquet or JSONL at ``uri`` (a file or a directory / prefix) as a Ray Dataset (see :func:`read_committed`).
    """
    return read_committed(uri, fmt, **read_args)[0]


def read_committed(uri: str, fmt: str | None = None, **read_args: Any) -> tuple[ray.data.Dataset, str | None]:
    """Read parquet or JSONL at ``uri`` (a file or a directory / prefix) as a Ray Dataset; and the version read,
    when ``uri`` is an output this provider wrote (``None`` otherwise).

    An output this provider wrote is read through its record: exactly the files of the version committed
    when the read starts, never a mix of two versions while another run replaces it
    (:func:`~airflow_provider_raytpu.workloads.outputs.committed_files`).

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
    committed = committed_files(location) if fmt == "parquet" else None
    version = committed[1] if committed is not None else None
    if committed is not None and not committed[0]:
        return ray.data.from_items([]), version
    if fmt == "parquet":
        paths = committed[0] if committed is not None else location.path
        return ray.data.read_parquet(paths, filesystem=location.filesystem, **read_args), version
    # pyarrow's JSON reader (lines=False) reads newline-delimited JSON; Ray 2.60's
    # lines=True reader (pandas) refuses an explicit filesystem, so it cannot reach GCS here.
    return ray.data.read_json(location.path, filesystem=location.filesystem, **read_args), None


def write_parquet_replacing(dataset: ray.data.Dataset, uri: str, owner: str = "",
                            attempt: Mapping[str, Any] | None = None,
                            **write_args: Any) -> tuple[Location, str, WriteResult[int | None]]:
    """Write ``dataset`` as parquet so that ``uri`` ends up holding exactly this output; where, the version
    committed, and what the write reported (:class:`~airflow_provider_raytpu.workloads.row_tally.CountingParquetSink`).

    A retried or re-run job replaces the output its task wrote before instead of adding
    duplicate rows; a prefix holding anything else is refused, and a job that dies while
    writing or swapping never leaves less than one complete output. Runs writing one output at
    once each stage apart and swap one at a time
    (:func:`~airflow_provider_raytpu.workloads.outputs.replace_output`).

    :param dataset: the dataset to write.
    :param uri: the output directory / prefix (not a whole bucket).
    :param owner: the task writing it; only an earlier output of the same owner is replaced.
    :param attempt: the run and try writing it (``{"run_id", "try_number"}``).
    :param write_args: passed on to ``Dataset.write_datasink`` (``ray_remote_args``, ``concurrency``).
    :raises OutputNotOwnedError: the prefix holds files this task did not write.
    :raises OutputLeaseBusyError: another run's swap held the output too long.
    """
    from airflow_provider_raytpu.workloads.row_tally import CountingParquetSink

    sink = None

    def write(at: Location) -> None:
        nonlocal sink
        sink = CountingParquetSink(at.path, filesystem=at.filesystem)
        dataset.write_datasink(sink, **write_args)

    target, version = replace_output(uri, owner, write, attempt)
    assert sink is not None and sink.written is not None, "replace_output writes once, and the write reports"
    return target, version, sink.written
