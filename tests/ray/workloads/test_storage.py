"""The storage seam: gs:// URIs reach the emulator (or real GCS), local paths stay local."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from airflow_provider_raytpu.workloads import storage
from airflow_provider_raytpu.workloads.session import worker_env_vars
from tests.support.gcs import GcsStorage


def test_emulator_env_derives_every_variable_from_the_host() -> None:
    env = storage.emulator_env({"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"})
    assert env == {
        "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
        "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:4443",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_CLOUD_PROJECT": "test-project",
    }


def test_emulator_env_keeps_values_already_set() -> None:
    env = storage.emulator_env(
        {"STORAGE_EMULATOR_HOST": "http://gcs:9000", "GOOGLE_CLOUD_PROJECT": "mine", "TENSORSTORE_GCS_HTTP_URL": "http://ts:1"}
    )
    assert env["GOOGLE_CLOUD_PROJECT"] == "mine" and env["TENSORSTORE_GCS_HTTP_URL"] == "http://ts:1"


def test_no_emulator_means_real_gcs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    assert storage.emulator_env() == {}
    location = storage.resolve("gs://prod-bucket/data/")
    assert isinstance(location.filesystem, pafs.GcsFileSystem)
    assert (location.uri, location.path, location.orbax_path) == ("gs://prod-bucket/data", "prod-bucket/data", "gs://prod-bucket/data")


def test_gcs_uri_resolves_to_the_emulator(fake_gcs: GcsStorage) -> None:
    location = storage.resolve(fake_gcs.uri("seam/a//b/"))
    assert location.uri == f"gs://{fake_gcs.bucket}/seam/a/b" and location.path == f"{fake_gcs.bucket}/seam/a/b"
    with location.filesystem.open_output_stream(location.child("x.json").path) as stream:
        stream.write(b'{"hello": 1}')
    # The object is on the emulator: ask the server itself, not pyarrow.
    assert fake_gcs.objects("seam/") == ["seam/a/b/x.json"]
    assert storage.exists(location.uri) and storage.exists(location.child("x.json").uri)
    assert not storage.exists(fake_gcs.uri("seam/nothing"))


@pytest.mark.parametrize("uri", ["gs://", "gs:///path", "gs://bucket/../other"])
def test_bad_gcs_uris(uri: str) -> None:
    with pytest.raises(ValueError):
        storage.resolve(uri)


def test_local_paths_and_file_uris(tmp_path: Path) -> None:
    for uri in (str(tmp_path / "out"), f"file://{tmp_path}/out", f"{tmp_path}/out/"):
        location = storage.resolve(uri)
        assert isinstance(location.filesystem, pafs.LocalFileSystem)
        assert location.uri == location.path == location.orbax_path == str(tmp_path / "out")


def test_uri_for_inverts_resolve(fake_gcs: GcsStorage, tmp_path: Path) -> None:
    for uri in (fake_gcs.uri("inv/x"), str(tmp_path / "inv")):
        location = storage.resolve(uri)
        assert storage.uri_for(location.filesystem, location.path) == location.uri


def test_child_and_sibling(fake_gcs: GcsStorage) -> None:
    location = storage.resolve(fake_gcs.uri("runs/r1"))
    assert location.child("orbax", "10").uri == f"gs://{fake_gcs.bucket}/runs/r1/orbax/10"
    assert location.sibling("r1.tmp").path == f"{fake_gcs.bucket}/runs/r1.tmp"
    with pytest.raises(ValueError):
        storage.resolve(f"gs://{fake_gcs.bucket}").sibling("x")


@pytest.mark.parametrize("where", ["gcs", "local"])
def test_list_and_delete(where: str, fake_gcs: GcsStorage, tmp_path: Path) -> None:
    root = storage.resolve(fake_gcs.uri() if where == "gcs" else str(tmp_path / "root"))
    fs = root.filesystem
    fs.create_dir(root.child("src", "sub").path, recursive=True)
    for name in ("src/a.txt", "src/sub/b.txt", "srcfile.txt"):
        with fs.open_output_stream(root.child(name).path) as stream:
            stream.write(name.encode())
    assert storage.list_files(root.child("src").uri) == [root.child("src/a.txt").path, root.child("src/sub/b.txt").path]

    storage.delete_prefix(root.child("never-there").uri)  # nothing to delete is fine
    # A prefix is a path component: deleting "src" did not touch "srcfile.txt".
    storage.delete_prefix(root.child("src").uri)
    assert not storage.exists(root.child("src").uri)
    assert storage.exists(root.child("srcfile.txt").uri)


def test_refuses_to_delete_a_bucket(fake_gcs: GcsStorage) -> None:
    with pytest.raises(ValueError, match="whole bucket"):
        storage.delete_prefix(f"gs://{fake_gcs.bucket}")


def test_apply_emulator_env_fills_in_missing_variables(fake_gcs: GcsStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    monkeypatch.delenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    storage.apply_emulator_env()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == fake_gcs.server.url
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"


def test_driver_passes_only_variables_the_job_does_not_set(fake_gcs: GcsStorage,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_env_vars() == {**fake_gcs.env, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    # A submitted job whose runtime_env already carries one of them: Ray refuses duplicate keys.
    job = {"runtime_env": {"env_vars": {"STORAGE_EMULATOR_HOST": fake_gcs.server.url,
                                        "RAY_TRAIN_ENABLE_PRINT_PATCH": "1"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert "STORAGE_EMULATOR_HOST" not in worker_env_vars()
    assert "RAY_TRAIN_ENABLE_PRINT_PATCH" not in worker_env_vars()  # the job's own choice wins
    assert worker_env_vars()["TENSORSTORE_GCS_HTTP_URL"] == fake_gcs.server.url
