"""What a user meets in the UI before any cluster runs: the DAGs parse in the real dag-processor, the
connection form shows the provider's fields, its Test button answers, and a bad slice param fails the
run's first task at once, with the named error in the task log."""

from __future__ import annotations

import json

from airflow_provider_raytpu.get_provider_info import CONN_FIELDS
from tests.deployment.deployment import EXPECTED_DAGS, AirflowDeployment, local_connection
from tests.deployment.rest import AirflowApi


def test_every_dag_parses_in_the_dag_processor(api: AirflowApi) -> None:
    assert api.import_errors() == []
    assert EXPECTED_DAGS <= api.dag_ids()


def test_connection_form_shows_the_raytpu_fields(api: AirflowApi) -> None:
    forms = {form["connection_type"]: form for form in api.hook_meta()}
    form = forms["raytpu"]
    assert form["hook_name"] == "Ray on TPU"
    assert set(form["extra_fields"]) == set(CONN_FIELDS)
    backend = form["extra_fields"]["backend"]
    assert backend["schema"]["enum"] == ["local", "kubernetes", "gke"]
    assert backend["schema"]["title"] == "Backend"
    hidden = {name for name, field in form["standard_fields"].items() if field and field["hidden"]}
    assert hidden == {"url_schema", "host", "port", "login", "password"}


def test_connection_test_button(deployment: AirflowDeployment, api: AirflowApi) -> None:
    good = api.test_connection(local_connection(deployment, "raytpu_form"))
    assert good["status"] is True, good
    assert good["message"].startswith("Local backend: Ray "), good
    assert str(deployment.raytpu_home) in good["message"]

    bad = {**local_connection(deployment, "raytpu_form"), "extra": json.dumps({"backend": "kuberay"})}
    answer = api.test_connection(bad)
    assert answer["status"] is False
    assert "extra.backend='kuberay'" in answer["message"]
    assert "Set it to one of ('local', 'kubernetes', 'gke')" in answer["message"]


def test_bad_slice_param_fails_fast_with_the_named_error_in_the_task_log(api: AirflowApi) -> None:
    api.unpause("raytpu_jobs")
    run_id = api.trigger("raytpu_jobs", {"accelerator": "v4", "topology": "3x3"})
    api.wait_task("raytpu_jobs", run_id, "create_cluster", ("failed",), timeout=180)
    # The DAG allows 2 retries; bad input uses none of them.
    assert [t["state"] for t in api.tries("raytpu_jobs", run_id, "create_cluster")] == ["failed"]
    log = "\n".join(api.log("raytpu_jobs", run_id, "create_cluster", 1))
    assert "topology='3x3'" in log, log  # the error names the field and the value (and the fix)
    assert api.wait_run("raytpu_jobs", run_id, timeout=180) == "failed"
