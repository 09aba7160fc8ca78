"""A run's files next to its checkpoints go through the Google provider's GCS hook to a real GCS API (fake-gcs-server):
the run report written, the training attempts' records read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_raytpu.hooks.run_files import read_files, write_report_files
from tests.support.gcs import GcsStorage


def test_a_report_goes_to_gcs_through_the_google_providers_hook_replacing_an_earlier_try(
        fake_gcs: GcsStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    monkeypatch.setenv("AIRFLOW_CONN_REPORTS_GCP", json.dumps(
        {"conn_type": "google_cloud_platform", "extra": {"is_anonymous": True, "project": "test-project"}}))
    folder = fake_gcs.uri("reports", "nightly", "scheduled__2026-12-05T00_00_00_00_00")
    write_report_files(folder, {"run_report.json": b'{"try": 1}'}, "reports_gcp")
    written = write_report_files(folder, {"run_report.json": b'{"try": 2}', "run_report.png": b"\x89PNG"},
                                 "reports_gcp")
    assert written == [f"{folder}/run_report.json", f"{folder}/run_report.png"]
    prefix = folder.split("/", 3)[3]
    assert sorted(fake_gcs.objects(prefix)) == [f"{prefix}/run_report.json", f"{prefix}/run_report.png"]
    url = f"{fake_gcs.server.url}/storage/v1/b/{fake_gcs.bucket}/o/{prefix.replace('/', '%2F')}%2Frun_report.json"
    with urllib.request.urlopen(url + "?alt=media") as answer:
        assert json.loads(answer.read()) == {"try": 2}
    with urllib.request.urlopen(url.replace("run_report.json", "run_report.png")) as answer:
        assert json.loads(answer.read())["contentType"] == "image/png"


def test_read_files_reads_the_named_files_directly_in_a_gcs_folder_and_a_local_one(
        fake_gcs: GcsStorage, tmp_path: Path) -> None:
    from airflow_provider_raytpu.workloads.storage import resolve, write_file

    folder = fake_gcs.uri("runs", "nightly.train-0123456789", "attempts")
    for name in ("attempt-1.json", "attempt-2.json", "summary.json", "attempt-3/nested.json"):
        write_file(resolve(f"{folder}/{name}"), name.encode())
        write_file(resolve(str(tmp_path / name)), name.encode())
    expected = {"attempt-1.json": b"attempt-1.json", "attempt-2.json": b"attempt-2.json"}
    assert read_files(folder, "attempt-", "google_cloud_default") == expected
    assert read_files(f"file://{tmp_path}", "attempt-", "google_cloud_default") == expected
    assert read_files(fake_gcs.uri("runs", "nothing-here"), "attempt-", "google_cloud_default") == {}
