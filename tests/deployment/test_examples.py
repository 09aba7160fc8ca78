"""An example DAG as a user first meets it: unpausing ``tpu_cluster_lifecycle`` (``@daily``, no
catchup) starts a scheduled run at once, with the example's default params. That run must be the
smallest slice, and it must clean up after itself."""

from __future__ import annotations

from tests.deployment.conftest import local_backend
from tests.deployment.deployment import AirflowDeployment
from tests.deployment.rest import AirflowApi

DAG_ID = "tpu_cluster_lifecycle"


def test_unpausing_the_example_runs_it_once_on_the_smallest_slice(deployment: AirflowDeployment,
                                                                   api: AirflowApi) -> None:
    api.unpause(DAG_ID)
    runs = api.wait("the run unpausing starts", lambda: api.runs(DAG_ID), 120)
    assert [run["run_type"] for run in runs] == ["scheduled"]
    run_id = runs[0]["dag_run_id"]
    assert api.wait_run(DAG_ID, run_id, timeout=300) == "success", api.run_report(DAG_ID, run_id)

    created = api.xcom(DAG_ID, run_id, "create_cluster")
    tpu = created["tpu"]
    assert (tpu["accelerator"], tpu["topology"], tpu["num_slices"], tpu["capacity"]) == ("v6e", "2x2", 1, "on-demand")
    assert api.xcom(DAG_ID, run_id, "delete_cluster")["deleted"] is True
    assert local_backend(deployment).get_cluster(created["cluster_name"], created["namespace"]) is None
