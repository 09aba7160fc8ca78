"""Dataset names as OpenLineage's naming spec gives them, so lineage joins with other tools' (``spec/Naming.md``)."""

from __future__ import annotations

import os

import pytest

from airflow_provider_raytpu.tasks.lineage import checkpoint_dataset, dataset_id, is_storage_uri


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


def test_a_checkpoint_is_a_version_of_the_checkpoint_uri_its_training_task_declared() -> None:
    assert checkpoint_dataset("gs://b/ckpt/run-1/orbax/30") == ("gs://b/ckpt", "run-1/orbax/30")
    assert checkpoint_dataset("gs://b/run-1/orbax/30/") == ("gs://b", "run-1/orbax/30")
    assert checkpoint_dataset("/mnt/models/30") == ("/mnt/models", "30")
    assert checkpoint_dataset("gs://b/ckpt/run-1/orbax/") == ("gs://b/ckpt/run-1/orbax", None)
    assert checkpoint_dataset("/30") == ("/30", None)
    assert [is_storage_uri(v) for v in ("gs://b/x", "/mnt/ckpt", "v2")] == [True, True, False]
