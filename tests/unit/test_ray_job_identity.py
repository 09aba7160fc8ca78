"""Ray job identity: deterministic per task try; retries versus a user's Clear."""

from __future__ import annotations

from types import SimpleNamespace

from airflow_provider_raytpu.hooks.ray_jobs import JobIdentity
from airflow_provider_raytpu.operators.ray_job import is_fresh_start
from airflow_provider_raytpu.workloads.result import last_result, report_result


def test_submission_id_is_deterministic_per_try() -> None:
    first = JobIdentity("dag", "train", "manual__1", -1, 1)
    assert first.submission_id == JobIdentity("dag", "train", "manual__1", -1, 1).submission_id
    assert first.submission_id != JobIdentity("dag", "train", "manual__1", -1, 2).submission_id
    assert first.task_key == JobIdentity("dag", "train", "manual__1", -1, 2).task_key
    assert first.task_key != JobIdentity("dag", "train", "manual__1", 0, 1).task_key
    assert first.metadata()["raytpu.try_number"] == "1"


def context(try_number: int, max_tries: int) -> dict:
    return {"ti": SimpleNamespace(try_number=try_number, max_tries=max_tries)}


def test_first_try_and_retries() -> None:
    # retries=2: tries 1..3 share max_tries=2
    assert is_fresh_start(context(1, 2), retries=2)
    assert not is_fresh_start(context(2, 2), retries=2)
    assert not is_fresh_start(context(3, 2), retries=2)


def test_clear_starts_a_new_cycle() -> None:
    # Cleared after try 3: Airflow sets max_tries = 3 + retries, the next try is 4.
    assert is_fresh_start(context(4, 5), retries=2)
    assert not is_fresh_start(context(5, 5), retries=2)


def test_result_line_round_trip(capsys) -> None:
    report_result({"rows": 3})
    report_result({"rows": 4, "uri": "gs://b/p"})
    logs = "noise\n" + capsys.readouterr().out + "more noise\n"
    assert last_result(logs) == {"rows": 4, "uri": "gs://b/p"}
    assert last_result("nothing here") is None


def test_default_cluster_name_is_one_per_run_and_valid() -> None:
    from airflow_provider_raytpu.operators.raycluster import default_cluster_name

    def name(dag_id: str, run_id: str) -> str:
        return default_cluster_name({"ti": SimpleNamespace(dag_id=dag_id, run_id=run_id)})

    first = name("nightly_finetune", "manual__2026-12-02T18:13:33.344560+00:00")
    assert first.startswith("nightly-finetune-") and len(first) <= 53
    assert first == name("nightly_finetune", "manual__2026-12-02T18:13:33.344560+00:00")
    assert first != name("nightly_finetune", "scheduled__2026-12-02T00:00:00+00:00")
    assert len(name("a_very_long_dag_id_" * 5, "r")) <= 53
