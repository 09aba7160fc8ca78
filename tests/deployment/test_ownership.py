"""Two DAGs whose ids differ only in ``_`` vs ``.`` (``etl_daily``, ``etl.daily``), scheduled once
for the same logical date: their run ids are the same, and each run must get, and delete, a cluster
of its own."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deployment.deployment import AirflowDeployment, local_backend
from tests.deployment.rest import AirflowApi

DAG_IDS = ("etl_daily", "etl.daily")


@pytest.fixture(scope="module")
def scheduled_runs(api: AirflowApi) -> dict[str, dict[str, Any]]:
    """Both DAGs unpaused together; each one's scheduled run, once finished."""
    for dag_id in DAG_IDS:
        api.unpause(dag_id)
    runs = {dag_id: api.wait(f"{dag_id}'s scheduled run", lambda d=dag_id: api.runs(d), 120)[0] for dag_id in DAG_IDS}
    for dag_id, run in runs.items():
        api.wait_run(dag_id, run["dag_run_id"], timeout=300)
    return {dag_id: api.run(dag_id, run["dag_run_id"]) for dag_id, run in runs.items()}


def test_both_dags_are_scheduled_for_the_same_logical_date(scheduled_runs: dict[str, dict[str, Any]]) -> None:
    first, second = (scheduled_runs[dag_id] for dag_id in DAG_IDS)
    assert first["run_type"] == second["run_type"] == "scheduled"
    assert first["dag_run_id"] == second["dag_run_id"]


def test_each_dag_gets_and_deletes_its_own_cluster(deployment: AirflowDeployment, api: AirflowApi,
                                                   scheduled_runs: dict[str, dict[str, Any]]) -> None:
    created, deleted = {}, {}
    for dag_id, run in scheduled_runs.items():
        assert run["state"] == "success", api.run_report(dag_id, run["dag_run_id"])
        created[dag_id] = api.xcom(dag_id, run["dag_run_id"], "create_cluster")
        deleted[dag_id] = api.xcom(dag_id, run["dag_run_id"], "delete_cluster")
    assert created["etl_daily"]["cluster_name"] != created["etl.daily"]["cluster_name"]
    for dag_id in DAG_IDS:
        assert (deleted[dag_id]["cluster_name"], deleted[dag_id]["deleted"]) == (created[dag_id]["cluster_name"], True)
        assert local_backend(deployment).get_cluster(created[dag_id]["cluster_name"], "default") is None
