"""Example DAGs as a user first meets them: unpausing ``tpu_cluster_lifecycle`` (``@daily``, no
catchup) starts a scheduled run at once, with the example's default params. That run must be the
smallest slice, and it must clean up after itself. ``after_promotion`` runs when the served model's
asset has a new event, and reads the event's extras."""

from __future__ import annotations

from datetime import datetime, timedelta

from tests.deployment.deployment import AirflowDeployment, local_backend
from tests.deployment.rest import AirflowApi

DAG_ID = "tpu_cluster_lifecycle"


def test_unpausing_the_example_runs_it_once_on_the_smallest_slice(deployment: AirflowDeployment,
                                                                   api: AirflowApi) -> None:
    api.unpause(DAG_ID)
    runs = api.wait("the run unpausing starts", lambda: api.runs(DAG_ID), 120)
    assert {run["run_type"] for run in runs} == {"scheduled"}, runs
    # One run; two when the DAG processor planned the next run before midnight UTC and the unpause came after
    # it (Airflow then runs that one and the day that has just ended: seen in CI at 00:04 UTC).
    days = [datetime.fromisoformat(run["logical_date"]) for run in runs]
    assert len(runs) == 1 or (len(runs) == 2 and days[1] - days[0] == timedelta(days=1)), runs
    run_id = runs[-1]["dag_run_id"]
    assert api.wait_run(DAG_ID, run_id, timeout=300) == "success", api.run_report(DAG_ID, run_id)

    created = api.xcom(DAG_ID, run_id, "create_cluster")
    tpu = created["tpu"]
    assert (tpu["accelerator"], tpu["topology"], tpu["num_slices"], tpu["capacity"]) == ("v6e", "2x2", 1, "on-demand")
    assert api.xcom(DAG_ID, run_id, "delete_cluster")["deleted"] is True
    assert local_backend(deployment).get_cluster(created["cluster_name"], created["namespace"]) is None


def test_a_new_served_model_runs_after_promotion_which_reads_what_the_event_says(api: AirflowApi) -> None:
    """The asset nightly_finetune's serving sensor marks (tests/ray/local_backend/test_demo.py checks the extras the
    demo's run puts there) schedules ``after_promotion``, whose task reads the event's extras: posted here
    through the REST API, as the scheduler receives any asset event."""
    api.unpause("after_promotion")
    (served,) = [a for a in api.call("GET", "/api/v2/assets", params={"name_pattern": "finetuned_regressor"})["assets"]
                 if a["name"] == "finetuned_regressor"]
    extra = {"service": "default/finetuned-regressor", "served_version": "gs://raytpu-demo/checkpoints/run/orbax/30"}
    api.call("POST", "/api/v2/assets/events", json={"asset_id": served["id"], "extra": extra})

    runs = api.wait("the run the event triggers", lambda: api.runs("after_promotion"), 120)
    assert [run["run_type"] for run in runs] == ["asset_triggered"]
    run_id = runs[0]["dag_run_id"]
    assert api.wait_run("after_promotion", run_id, timeout=300) == "success", api.run_report("after_promotion", run_id)
    (promotion,) = api.xcom("after_promotion", run_id, "record_promotion")
    assert {key: promotion[key] for key in extra} == extra
