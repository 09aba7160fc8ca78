"""Parquet files as an output's writer makes them, and the rows a reader of an output sees (local and fake GCS)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_raytpu.workloads import outputs, storage
from tests.support.gcs import GcsStorage


def writer(rows: list[int]) -> Callable[[storage.Location], None]:
    """Writes ``rows`` as two parquet files with fresh names, as one Ray Data write does."""
    def write(at: storage.Location) -> None:
        token = uuid.uuid4().hex[:8]
        for part, chunk in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2:])):
            storage.write_file(at.child(f"{token}_{part}.parquet"), parquet_bytes(chunk))
    return write


def parquet_bytes(rows: list[int]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": rows}), sink)
    return sink.getvalue().to_pybytes()


def read_rows(paths: list[str], filesystem: object) -> list[int]:
    if not paths:
        return []
    return sorted(pq.ParquetDataset(paths, filesystem=filesystem).read().column("id").to_pylist())


def rows_at(uri: str) -> list[int]:
    """Every row of the parquet files under ``uri`` (what a reader of the whole prefix sees), sorted."""
    location = storage.resolve(uri)
    return read_rows([f for f in storage.list_files(uri) if f.endswith(".parquet")], location.filesystem)


def listed_rows(uri: str) -> list[int]:
    """The rows of the files the output's record lists as the output (what the provider's readers see)."""
    location = storage.resolve(uri)
    committed = outputs.committed_files(location)
    assert committed is not None, f"{uri} has no record"
    return read_rows(committed[0], location.filesystem)


@pytest.fixture(params=["local", "gcs"])
def output(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An output prefix that does not exist yet, on local disk or on the fake GCS."""
    if request.param == "local":
        return str(tmp_path / "out" / "clean")
    fake_gcs: GcsStorage = request.getfixturevalue("fake_gcs")
    return fake_gcs.uri(uuid.uuid4().hex[:8], "clean")
