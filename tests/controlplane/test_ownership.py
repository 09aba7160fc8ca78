"""What the real KubeRay operator does where DAGs share a namespace: a spec change, a quota refusal.

- A PUT of a new slice shape alone leaves the old hosts running next to new ones. Where the CRD
  has RayCluster ``upgradeStrategy`` (KubeRay 1.6 and newer, as this control plane runs)
  ``update_if_exists`` updates the cluster with ``Recreate``: KubeRay replaces every pod, and the
  sensor counts none of the old shape.
- A pod refused by a ResourceQuota is a reconcile error: KubeRay sets ``ReplicaFailure``
  (``FailedCreateWorkerPod``) and clears it once the pod can be created. The ready sensor
  waits it out instead of failing.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import (
    HOST_INDEX,
    TPU_TOPOLOGY_LABEL,
    V6E,
    NodePools,
    get_json,
    rayclusters,
    states,
    wait_for,
    wait_no_pods,
)
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(480), pytest.mark.usefixtures("admin_connections")]

LOGICAL_DATE = datetime(2026, 12, 2, tzinfo=UTC)

RECREATE = '''
from datetime import datetime
from airflow.sdk import DAG, task
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("k8s_recreate", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", num_slices=2,
                                      update_if_exists=True, {shape})
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=240, poke_interval=1)

    @task
    def hosts(reference):
        """The TPU host pods as they are when the sensor said ready (pod uid and node), and the RayCluster's uid
        and upgradeStrategy."""
        backend = RayTpuHook().backend
        pods = backend.cluster_pods(reference["cluster_name"], reference["namespace"])
        cluster = backend.get_cluster(reference["cluster_name"], reference["namespace"])
        return {{"cluster": [cluster["metadata"]["uid"], cluster["spec"].get("upgradeStrategy")],
                "hosts": sorted([p["metadata"]["uid"], p["spec"].get("nodeName")] for p in pods
                                if p["metadata"]["labels"].get("ray.io/node-type") == "worker")}}

    snapshot = hosts(create.output)
    ready >> snapshot
    {teardown}
'''


@pytest.fixture(scope="module")
def v6e_nodes(module_node_pools: NodePools, head_nodes: list[str]) -> dict[str, list[str]]:
    """Two v6e 2x2 slices (one 4-chip host each) and two v6e 2x4 slices of two 4-chip hosts."""
    return {"2x2": module_node_pools.add("v6e-2x2", tpu=V6E, topology="2x2", num_nodes=2).nodes,
            "2x4": module_node_pools.add("v6e-2x4", tpu=V6E, topology="2x4", num_nodes=4).nodes}


def node_topology(cp: ControlPlane, node: str) -> str:
    status, body = get_json(cp, f"/api/v1/nodes/{node}")
    assert status == 200, body
    return body["metadata"]["labels"][TPU_TOPOLOGY_LABEL]


def test_a_new_slice_shape_with_update_if_exists_recreates_the_cluster(
        airflow_home: Path, k8s_control_plane: ControlPlane, v6e_nodes: dict[str, list[str]], namespace: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    cp = k8s_control_plane
    first = run_dag(airflow_home, RECREATE.format(shape="topology='2x2'", teardown=""), "k8s_recreate",
                    logical_date=LOGICAL_DATE)
    assert states(first) == {"create_cluster": "success", "wait_ready": "success", "hosts": "success"}, first
    name = first["create_cluster"].result["cluster_name"]
    old_uid = rayclusters(cp, namespace)[0]["metadata"]["uid"]
    assert {node_topology(cp, node) for _, node in first["hosts"].result["hosts"]} == {"2x2"}

    # The same task of the same run, the DAG edited to v6e 2x4 slices of two 4-chip hosts.
    teardown = "delete = DeleteRayClusterOperator(task_id='delete_cluster', wait_for_deletion=True)\n" \
               "    snapshot >> delete.as_teardown(setups=[create, ready])"
    second = run_dag(airflow_home, RECREATE.format(shape="topology='2x4', chips_per_host=4", teardown=teardown),
                     "k8s_recreate", logical_date=LOGICAL_DATE)
    assert states(second) == {"create_cluster": "success", "wait_ready": "success", "hosts": "success",
                              "delete_cluster": "success"}, second
    assert second["create_cluster"].result["cluster_name"] == name
    assert f"RayCluster {namespace}/{name} updated" in capfd.readouterr().out
    assert second["hosts"].result["cluster"] == [old_uid, {"type": "Recreate"}], "updated in place, not deleted"
    assert second["wait_ready"].result["ready_hosts"] == 4
    hosts = second["hosts"].result["hosts"]
    # Every host of the ready cluster is a new pod on a 2x4 node: none of the old shape is counted.
    assert {node_topology(cp, node) for _, node in hosts} == {"2x4"}, hosts
    assert not {uid for uid, _ in hosts} & {uid for uid, _ in first["hosts"].result["hosts"]}
    assert second["delete_cluster"].result["cluster_names"] == [name]
    assert rayclusters(cp, namespace) == []
    wait_no_pods(cp, namespace)


QUOTA_DAG = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("k8s_quota", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    create = CreateRayClusterOperator(task_id="create_cluster", cluster_name="quota", accelerator="v6e",
                                      topology="2x4", chips_per_host=4)
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=240, poke_interval=1)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", wait_for_deletion=True)
    create >> ready >> delete.as_teardown(setups=[create, ready])
'''


def replica_failure(cp: ControlPlane, namespace: str) -> dict | None:
    status, body = get_json(cp, f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters/quota")
    if status != 200:
        return None
    return next((c for c in (body.get("status") or {}).get("conditions") or []
                 if c["type"] == "ReplicaFailure" and c["status"] == "True"), None)


ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def refuse_second_hosts(cp: ControlPlane, namespace: str) -> str:
    """Refuse the creation of every pod of host index 1 in ``namespace`` (a ValidatingAdmissionPolicy and its
    binding, named after the namespace), as a quota with room for the head and one host would; returns the
    name. Waits until the API server applies it (a dry-run create is refused)."""
    name = f"refuse-second-host-{namespace}"
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name}, "spec": {
                  "failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                          "operations": ["CREATE"], "resources": ["pods"]}]},
                  "validations": [{"expression": f"!has(object.metadata.labels) || !('{HOST_INDEX}' in "
                                                 f"object.metadata.labels) || object.metadata.labels['{HOST_INDEX}'] "
                                                 "!= '1'",
                                   "message": "exceeded quota: a second TPU host does not fit this namespace"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name}, "spec": {
                   "policyName": name, "validationActions": ["Deny"],
                   "matchResources": {"namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": namespace}}}}}
    for kind, body in (("validatingadmissionpolicies", policy), ("validatingadmissionpolicybindings", binding)):
        status, answer = cp.request("POST", f"{ADMISSION}/{kind}", json.dumps(body).encode())
        assert status == 201, answer
    probe = json.dumps({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "probe", "labels": {HOST_INDEX: "1"}},
                        "spec": {"containers": [{"name": "c", "image": "probe"}]}}).encode()

    def refused() -> bool:
        status, answer = cp.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", probe)
        return status == 422 and b"ValidatingAdmissionPolicy" in answer

    wait_for(refused, 60, "the admission policy applied")
    return name


def test_a_worker_pod_refused_at_admission_is_waited_out(
        airflow_home: Path, k8s_control_plane: ControlPlane, v6e_nodes: dict[str, list[str]], namespace: str,
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """The slice's second host is refused at creation, as an exhausted ResourceQuota refuses it on GKE, until the
    refusal is lifted; the wait holds through KubeRay's ReplicaFailure and ends READY. The refusal is an admission
    policy, not a quota: the quota controller recounts a quota's usage from its cache and, while that lags, admits
    the pod after all (seen in a CI run: the failure cleared within 0.1 s)."""
    cp = k8s_control_plane
    policy = refuse_second_hosts(cp, namespace)
    seen: dict[str, dict] = {}
    errors: list[BaseException] = []

    def raise_the_quota() -> None:
        try:
            seen["failure"] = wait_for(lambda: replica_failure(cp, namespace), 180, "KubeRay's ReplicaFailure")
            # Hold the failure for many of the sensor's 1-s pokes: lifted at once, the next good
            # reconcile can clear it before the wait reads the cluster again.
            time.sleep(15)
            for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                status, body = cp.request("DELETE", f"{ADMISSION}/{kind}/{policy}")
                assert status == 200, body
        except BaseException as exc:  # reported below
            errors.append(exc)

    helper = threading.Thread(target=raise_the_quota, daemon=True)
    helper.start()
    outcome = run_dag(airflow_home, QUOTA_DAG, "k8s_quota")
    helper.join(30)
    assert not errors, errors
    assert seen["failure"]["reason"] == "FailedCreateWorkerPod", seen["failure"]
    assert "exceeded quota" in seen["failure"]["message"]
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    assert outcome["wait_ready"].try_number == 1 and outcome["wait_ready"].result["ready_hosts"] == 2
    log = capfd.readouterr().out + caplog.text  # a deferred wait's trigger logs through Python logging
    assert "KubeRay cannot reconcile it since " in log and "(FailedCreateWorkerPod: " in log
    wait_no_pods(cp, namespace)
