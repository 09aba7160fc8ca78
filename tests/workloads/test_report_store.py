"""A run report written to ``gs://`` goes through the Google provider's GCS hook to a real GCS API (fake-gcs-server)."""

from __future__ import annotations

import json

import pytest

from airflow_provider_raytpu.hooks.report_store import write_report_files
from tests.gcs import GcsStorage


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
