"""Dataset names as OpenLineage's naming spec gives them, so lineage joins with other tools' (``spec/Naming.md``)."""

from __future__ import annotations

import os

import pytest

from airflow_provider_raytpu.operators.lineage import checkpoint_directory, dataset_id, is_storage_uri


@pytest.mark.parametrize(("uri", "expected"), [
    ("gs://bucket/raw/rows.jsonl", ("gs://bucket", "raw/rows.jsonl")),
    ("gs://bucket/features/2026-12-05/", ("gs://bucket", "features/2026-12-05")),
    ("gs://bucket", ("gs://bucket", "/")),
    ("s3://b/k", ("s3://b", "k")),
    ("file:///data/x/", ("file", "/data/x")),
    ("/data/x/../y", ("file", "/data/y")),
])
def test_a_storage_uri_is_named_by_its_bucket_and_path(uri: str, expected: tuple[str, str]) -> None:
    assert dataset_id(uri) == expected


def test_a_relative_local_path_is_named_by_its_absolute_path() -> None:
    assert dataset_id("data/x") == ("file", os.path.join(os.getcwd(), "data", "x"))


def test_a_checkpoint_step_belongs_to_its_runs_directory() -> None:
    assert checkpoint_directory("gs://b/ckpt/run-1/orbax/30") == "gs://b/ckpt/run-1/orbax"
    assert checkpoint_directory("gs://b/ckpt/run-1/orbax/") == "gs://b/ckpt/run-1/orbax"
    assert [is_storage_uri(v) for v in ("gs://b/x", "/mnt/ckpt", "v2")] == [True, True, False]
