"""RayService deploy, promotion and rollback (operators and backend) against a Kubernetes API over HTTP."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.errors import ConflictError, PermissionDeniedError
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin
from airflow_provider_raytpu.manifests.rayservice import (
    MODEL_VERSION_ANNOTATION,
    build_ray_service,
    cluster_version,
    version_history,
)
from airflow_provider_raytpu.operators.rayservice import DeleteRayServiceOperator, RollbackRayServiceOperator
from airflow_provider_raytpu.tpu import TpuSlice
from tests.fakeapi.serving_dags import LLM_APP, SERVICES, dag
from tests.support.airflow_runner import run_dag
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

pytestmark = pytest.mark.timeout(120)


def test_deploy_creates_and_the_same_version_again_is_a_no_op(airflow_home: Path, connections: None,
                                                              kube: FakeKubeApiServer) -> None:
    first = run_dag(airflow_home, dag("deploy_once"), "deploy_once")
    again = run_dag(airflow_home, dag("deploy_once"), "deploy_once")
    assert first["deploy"].state == again["deploy"].state == "success"
    assert kube.count("POST", SERVICES + "$") == 1
    assert kube.count("PUT", SERVICES) == 0
    reference = first["deploy"].result
    assert reference == {
        "service_name": "chat",
        "namespace": NAMESPACE,
        "raytpu_conn_id": "raytpu_default",
        "version": "gs://b/ckpt-1",
        "previous_version": None,
        "tpu": {"accelerator": "v6e", "topology": "4x4", "num_slices": 1, "chips_per_host": None,
                "capacity": "on-demand"},
        "serve_url": f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services/chat-serve-svc:serve/proxy",
    }
    assert again["deploy"].result == reference
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    post = next(r for r in kube.requests if r.method == "POST")
    assert post.query.get("fieldValidation") == "Strict"
    (llm_config,) = yaml.safe_load(stored["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    assert llm_config["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    assert llm_config["model_loading_config"]["model_source"] == "gs://b/ckpt-1"


def test_promote_writes_the_version_into_the_cluster_config(airflow_home: Path, connections: None,
                                                            kube: FakeKubeApiServer) -> None:
    run_dag(airflow_home, dag("promote"), "promote")
    before = kube.get_object("rayservices", NAMESPACE, "chat")
    outcome = run_dag(airflow_home, dag("promote"), "promote", conf={"version": "gs://b/ckpt-2"})
    assert outcome["deploy"].result["previous_version"] == "gs://b/ckpt-1"
    assert outcome["deploy"].result["version"] == "gs://b/ckpt-2"
    assert (kube.count("POST", SERVICES + "$"), kube.count("PUT", SERVICES + "/chat$")) == (1, 1)
    after = kube.get_object("rayservices", NAMESPACE, "chat")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    notes = after["metadata"]["annotations"]
    assert notes[MODEL_VERSION_ANNOTATION] == "gs://b/ckpt-2"
    assert json.loads(notes["raytpu.dev/version-history"]) == ["gs://b/ckpt-1", "gs://b/ckpt-2"]
    assert notes["raytpu.dev/update"] == "new-cluster"
    config = after["spec"]["rayClusterConfig"]
    assert cluster_version({"spec": config}) == "gs://b/ckpt-2"
    worker = config["workerGroupSpecs"][0]["template"]["metadata"]["annotations"]
    assert worker[MODEL_VERSION_ANNOTATION] == "gs://b/ckpt-2"
    assert cluster_version({"spec": before["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"


def test_rollback_promotes_the_previous_version_and_a_retry_keeps_it(airflow_home: Path, connections: None,
                                                                     kube: FakeKubeApiServer) -> None:
    run_dag(airflow_home, dag("versions"), "versions")
    run_dag(airflow_home, dag("versions"), "versions", conf={"version": "gs://b/ckpt-2"})
    def rollback_dag(dag_id: str) -> str:
        return dag(dag_id, deploy=None).replace(
            "params={'version': 'gs://b/ckpt-1'}):",
            "params={}):\n    RollbackRayServiceOperator(task_id='rollback', service_name='chat')")

    puts = kube.count("PUT", SERVICES + "/chat$")
    refused = run_dag(airflow_home, rollback_dag("other_team"), "other_team")  # not the DAG that deployed it
    assert (refused["rollback"].state, refused["rollback"].try_number) == ("failed", 1)
    assert kube.count("PUT", SERVICES + "/chat$") == puts
    outcome = run_dag(airflow_home, rollback_dag("versions"), "versions")
    assert outcome["rollback"].state == "success"
    assert (outcome["rollback"].result["version"], outcome["rollback"].result["previous_version"]) == (
        "gs://b/ckpt-1", "gs://b/ckpt-2")
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    assert version_history(stored) == ["gs://b/ckpt-1", "gs://b/ckpt-2", "gs://b/ckpt-1"]
    assert cluster_version({"spec": stored["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"
    source_args = yaml.safe_load(stored["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert source_args["llm_configs"][0]["model_loading_config"]["model_source"] == "gs://b/ckpt-1"
    # The RayService keeps its owner (the deploy task of DAG 'versions'); the rollback is recorded apart.
    notes = stored["metadata"]["annotations"]
    assert (notes["raytpu.dev/dag-id"], notes["raytpu.dev/task-id"]) == ("versions", "deploy")
    dag_id, run_id, task_id, version = json.loads(notes["raytpu.dev/rolled-back-by"])
    assert (dag_id, task_id, version) == ("versions", "rollback", "gs://b/ckpt-1")
    # A retry of the same task (same run) must not toggle back to ckpt-2.
    links: dict[str, Any] = {}
    ti = SimpleNamespace(dag_id="versions", run_id=run_id, task_id="rollback", map_index=-1,
                         xcom_push=lambda key, value: links.__setitem__(key, value))
    retry = RollbackRayServiceOperator(task_id="rollback", service_name="chat")
    puts = kube.count("PUT", SERVICES + "/chat$")
    assert retry.execute({"ti": ti})["version"] == "gs://b/ckpt-1"
    assert kube.count("PUT", SERVICES + "/chat$") == puts
    # The task page's links: through the API server's service proxy, the transport in use.
    proxy = f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services"
    assert links == {"_link_ServeApplicationLink": f"{proxy}/chat-head-svc:dashboard/proxy/#/serve/applications/chat"}


def test_a_rollback_never_changes_a_service_made_after_its_owner_check(airflow_home: Path, connections: None,
                                                                         kube: FakeKubeApiServer) -> None:
    run_dag(airflow_home, dag("versions"), "versions")
    run_dag(airflow_home, dag("versions"), "versions", conf={"version": "gs://b/ckpt-2"})
    theirs = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP],
                               version="gs://b/theirs", origin=AirflowOrigin("other_team", "manual__1", "deploy"))

    def replaced() -> None:  # another DAG deleted the service and made its own under the name
        kube.delete_object("rayservices", NAMESPACE, "chat", force=True)
        kube.create_object(theirs)

    puts = kube.count("PUT", SERVICES + "/chat$")
    kube.before("PUT", SERVICES + "/chat$", replaced)
    source = dag("versions", deploy=None).replace(
        "params={'version': 'gs://b/ckpt-1'}):",
        "params={}):\n    RollbackRayServiceOperator(task_id='rollback', service_name='chat', retries=0)")
    assert run_dag(airflow_home, source, "versions")["rollback"].state == "failed"
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    assert stored["metadata"]["annotations"]["raytpu.dev/dag-id"] == "other_team"
    assert cluster_version({"spec": stored["spec"]["rayClusterConfig"]}) == "gs://b/theirs"
    assert kube.count("PUT", SERVICES + "/chat$") == puts + 1, "the refused write was not retried on the new service"


def test_params_choose_the_serving_cluster_options(airflow_home: Path, connections: None,
                                                   kube: FakeKubeApiServer) -> None:
    from airflow_provider_raytpu.manifests.options import RayClusterOptions
    from airflow_provider_raytpu.manifests.raycluster import SPEC_HASH_ANNOTATION

    options = ("cluster_options={'image': '{{ params.image }}', 'worker_resources': {'cpu': '{{ params.worker_cpu }}', "
               "'memory': '64Gi'}, 'labels': {'team': '{{ params.team }}'}}")
    source = dag("serve_options", deploy=options).replace(
        "params={'version': 'gs://b/ckpt-1'}",
        "params={'version': 'gs://b/ckpt-1', 'image': 'rayproject/ray:2.60.0-py311-tpu', 'worker_cpu': '8', "
        "'team': 'ml'}")
    outcome = run_dag(airflow_home, source, "serve_options",
                      conf={"image": "rayproject/ray-llm:2.61.0-py311-tpu", "worker_cpu": "40", "team": "research"})
    assert outcome["deploy"].state == "success"
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    config = stored["spec"]["rayClusterConfig"]
    (worker,) = config["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert config["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == worker["image"] == (
        "rayproject/ray-llm:2.61.0-py311-tpu")
    assert config["rayVersion"] == "2.61.0"
    assert worker["resources"]["limits"] == {"cpu": "40", "memory": "64Gi", "google.com/tpu": "4"}
    assert stored["metadata"]["labels"]["team"] == "research"
    by_hand = build_ray_service(
        name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP], version="gs://b/ckpt-1",
        options=RayClusterOptions(image="rayproject/ray-llm:2.61.0-py311-tpu", labels={"team": "research"},
                                  worker_resources={"cpu": "40", "memory": "64Gi"}))
    assert (stored["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
            == by_hand["metadata"]["annotations"][SPEC_HASH_ANNOTATION])


def test_bad_input_fails_before_any_api_call(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    source = dag("no_topology").replace(f"APPS = {LLM_APP!r}", "APPS = " + repr({
        **LLM_APP, "args": {"llm_configs": [{"model_loading_config": {"model_id": "m"},
                                             "accelerator_config": {"kind": "tpu"}}]}}))
    outcome = run_dag(airflow_home, source, "no_topology")
    assert (outcome["deploy"].state, outcome["deploy"].try_number) == ("failed", 1)
    assert kube.count("POST") == 0 and kube.count("PUT") == 0


def test_backend_conflicts_and_permissions(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    manifest = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"),
                                 applications=[LLM_APP], version="v1")
    foreign = copy.deepcopy(manifest)
    foreign["metadata"]["labels"] = {}
    kube.create_object(foreign)
    with pytest.raises(ConflictError, match="not made by this provider"):
        backend.services.apply_service(manifest)
    kube.delete_object("rayservices", NAMESPACE, "chat", force=True)
    assert backend.services.apply_service(manifest).action is Applied.CREATED
    # KubeRay wrote the status between our read and our write: the stale PUT is retried.
    kube.inject("PUT", SERVICES + "/chat$", 409)
    promoted = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP],
                                 version="v2", current=backend.services.get_service("chat", NAMESPACE))
    assert backend.services.apply_service(promoted).action is Applied.UPDATED
    assert kube.count("PUT", SERVICES + "/chat$") == 2
    assert backend.services.apply_service(promoted).action is Applied.ADOPTED
    kube.deny("create", "rayservices")
    with pytest.raises(PermissionDeniedError, match="may not create rayservices.ray.io in namespace 'ml'"):
        backend.services.apply_service(build_ray_service(name="other", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"),
                                                applications=[LLM_APP], version="v1"))
    assert backend.services.delete_service("chat", NAMESPACE) is True
    assert backend.services.delete_service("chat", NAMESPACE) is False


def test_delete_operator_succeeds_when_gone(connections: None, kube: FakeKubeApiServer) -> None:
    context: Any = {"ti": SimpleNamespace(dag_id="d", run_id="r", task_id="delete", map_index=-1)}
    delete = DeleteRayServiceOperator(task_id="delete", service_name="chat", wait_for_deletion=True, poll_interval=0.1)
    assert delete.execute(context) == {"service_name": "chat", "service_names": ["chat"], "namespace": NAMESPACE,
                                       "deleted": False, "skipped": []}


def test_each_map_index_of_an_expanded_deploy_gets_its_own_rayservice(airflow_home: Path, connections: None,
                                                                      kube: FakeKubeApiServer) -> None:
    source = f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator

with DAG("serve_models", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    DeployRayServiceOperator.partial(task_id="deploy", applications=[{LLM_APP!r}], accelerator="v6e",
                                     topology="4x4").expand(version=["gs://b/model-a", "gs://b/model-b"])
'''
    first = run_dag(airflow_home, source, "serve_models")
    references = [first[f"deploy[{i}]"].result for i in (0, 1)]
    names = [reference["service_name"] for reference in references]
    assert len(set(names)) == 2, "map indexes 0 and 1 replaced each other's applications"
    assert [reference["previous_version"] for reference in references] == [None, None]
    for i, (name, version) in enumerate(zip(names, ["gs://b/model-a", "gs://b/model-b"], strict=True)):
        notes = kube.get_object("rayservices", NAMESPACE, name)["metadata"]["annotations"]
        assert (notes[MODEL_VERSION_ANNOTATION], notes["raytpu.dev/map-index"]) == (version, str(i))
        assert json.loads(notes["raytpu.dev/version-history"]) == [version]
    again = run_dag(airflow_home, source, "serve_models")
    assert [again[f"deploy[{i}]"].result["service_name"] for i in (0, 1)] == names, "later runs promote the same"
    assert kube.count("POST", SERVICES + "$") == 2


def test_a_named_delete_leaves_another_dags_rayservice_alone(airflow_home: Path, connections: None,
                                                           kube: FakeKubeApiServer,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    run_dag(airflow_home, dag("owner_dag"), "owner_dag")
    source = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.rayservice import DeleteRayServiceOperator

with DAG("other_dag", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteRayServiceOperator(task_id="delete", service_name="chat")
'''
    outcome = run_dag(airflow_home, source, "other_dag")
    assert outcome["delete"].result["skipped"] == ["chat"]
    assert kube.get_object("rayservices", NAMESPACE, "chat") is not None
    assert kube.count("DELETE", SERVICES) == 0
    assert "Not deleting RayService ml/chat: it belongs to DAG 'owner_dag'" in capfd.readouterr().out
