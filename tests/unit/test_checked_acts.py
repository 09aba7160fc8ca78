"""What a delete or a rollback checks before it acts: the object's identity, the sweep's reading of a DAG run
lookup, and the rollback's owner. Pure; the raced versions run against the fake API server in
tests/fakeapi/test_races.py.
"""

from __future__ import annotations

import httpx
import pytest
from airflow.sdk.api.client import ServerResponseError
from airflow.sdk.exceptions import AirflowRuntimeError, ErrorType
from airflow.sdk.execution_time.comms import ErrorResponse

from airflow_provider_raytpu.backends.base import ChangedSinceChecked, Precondition
from airflow_provider_raytpu.errors import ConflictError
from airflow_provider_raytpu.manifests.raycluster import DEPLOYMENT_KEY, MANAGED_BY_LABEL, AirflowOrigin
from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.tasks.expiry import run_gone
from airflow_provider_raytpu.tasks.promotion import check_rollback_owner
from airflow_provider_raytpu.tpu import TpuSlice

STORED = {"metadata": {"name": "train", "namespace": "ml", "uid": "u-1", "resourceVersion": "41"}}


def test_a_precondition_names_the_checked_object_and_what_differs() -> None:
    assert Precondition.of(STORED) == Precondition("u-1")
    assert Precondition.of(STORED, exact=True) == Precondition("u-1", "41")
    assert Precondition("u-1").unmet(STORED) is None
    assert Precondition("u-1").unmet({"metadata": {**STORED["metadata"], "resourceVersion": "42"}}) is None
    assert Precondition("u-0").unmet(STORED) == "uid u-1, checked u-0"
    assert Precondition("u-1", "40").unmet(STORED) == "resourceVersion 41, checked 40"
    message = str(ChangedSinceChecked("RayCluster", "train", "ml", "uid u-1, checked u-0"))
    assert message == "RayCluster ml/train changed since it was checked: not deleted (uid u-1, checked u-0)"


def api_error(status: int) -> ServerResponseError:
    request = httpx.Request("GET", "http://execution-api/dag-runs/d/r/state")
    response = httpx.Response(status, request=request, json={"detail": "x"})
    return ServerResponseError("Server returned error", request=request, response=response)


@pytest.mark.parametrize(("error", "gone"), [
    (AirflowRuntimeError(ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail={"status_code": 404})), True),
    (AirflowRuntimeError(ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail={"status_code": 503})), False),
    (AirflowRuntimeError(ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail={"status_code": None,
                                                                                 "message": "timed out"})), False),
    (api_error(404), True),
    (api_error(500), False),
    (ConnectionError("reset by peer"), False),
], ids=["worker-404", "worker-503", "worker-no-answer", "in-process-404", "in-process-500", "other"])
def test_only_a_404_reads_as_a_deleted_run(error: Exception, gone: bool) -> None:
    assert run_gone(error) is gone


def service(dag_id: str = "serving") -> dict:
    return build_ray_service(name="chat", namespace="ml", tpu=TpuSlice("v6e", "2x2"), version="v2",
                             applications=[{"name": "chat", "import_path": "m:app", "version_arg": "v"}],
                             origin=AirflowOrigin(dag_id, "run-1", "deploy"))


def test_any_task_of_the_deploying_dag_rolls_back_its_service() -> None:
    check_rollback_owner(service(), AirflowOrigin("serving", "run-9", "roll_back"))


def test_another_dag_never_rolls_back_a_service_it_did_not_deploy() -> None:
    with pytest.raises(ConflictError) as info:
        check_rollback_owner(service(), AirflowOrigin("other_team", "run-9", "roll_back"))
    assert str(info.value) == (
        "RayService ml/chat belongs to DAG 'serving', run 'run-1', task 'deploy', not to DAG 'other_team', so it is "
        "not rolled back. Roll it back from a task of the DAG that deployed it")
    hand_made = service()
    del hand_made["metadata"]["labels"][MANAGED_BY_LABEL]
    with pytest.raises(ConflictError, match="belongs to no task of this provider"):
        check_rollback_owner(hand_made, AirflowOrigin("serving", "run-9", "roll_back"))


def test_the_same_dag_in_another_airflow_deployment_never_rolls_back_the_service() -> None:
    staging = service()
    staging["metadata"]["annotations"][DEPLOYMENT_KEY] = "staging"
    check_rollback_owner(staging, AirflowOrigin("serving", "run-9", "roll_back", deployment="staging"))
    with pytest.raises(ConflictError, match="belongs to DAG 'serving', run 'run-1', task 'deploy', deployment "
                                            "'staging', not to DAG 'serving'"):
        check_rollback_owner(staging, AirflowOrigin("serving", "run-9", "roll_back", deployment="prod"))
