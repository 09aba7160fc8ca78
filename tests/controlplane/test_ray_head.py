"""A real Ray head in the KubeRay head pod: Ray jobs and a RayService through the real API server.

The real KubeRay operator makes the head pod and its head Service; the virtual kubelet runs
the pod's own ``ray start --head`` command on this machine (tests/controlplane/hostpods.py), the real
controller manager publishes the pod in the Service's endpoints, and every Jobs API call of
``SubmitRayJobOperator`` (package upload, submit, status, logs) goes through
``/api/v1/namespaces/<ns>/services/<cluster>-head-svc:dashboard/proxy`` under the
least-privilege Role of docs/rbac.yaml. A RayService reaches Ready through the real operator,
which (``--use-kubernetes-proxy``) puts the Serve config on the head and health-checks its Serve
proxy through the same API server.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from airflow_provider_raytpu.backends.local.process import port_open
from airflow_provider_raytpu.manifests.raycluster import DASHBOARD_PORT
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import Connections, NodePools, documented_role, host_pod_addresses, states, wait_no_pods
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600)]

V4 = "tpu-v4-podslice"
EXAMPLES = Path(__file__).resolve().parents[2] / "example_dags"


@pytest.fixture(scope="module")
def head_pool(module_node_pools: NodePools) -> str:
    """A node whose pods really run (this machine's address) for the head, and one v4 2x2x2 slice;
    the head's node pool name."""
    head = module_node_pools.add("ray-head", cpu_nodes=1, host_processes=True).name
    module_node_pools.add("v4-head", tpu=V4, topology="2x2x2")
    return head


def service_proxy_requests(cp: ControlPlane) -> dict[str, int]:
    """``apiserver_request_total`` for ``services/proxy``, per verb, from the API server's own metrics."""
    status, body = cp.request("GET", "/metrics")
    assert status == 200
    counts: dict[str, int] = {}
    for line in body.decode().splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="services"' in line \
                and 'subresource="proxy"' in line:
            verb = re.search(r'verb="([A-Z]+)"', line).group(1)
            counts[verb] = counts.get(verb, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


JOB_DAG = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

CODE = """
import ray
from airflow_provider_raytpu.workloads.result import report_result
ray.init()
print("hello from the head pod", flush=True)
report_result({"nodes": len(ray.nodes()), "cpus": ray.cluster_resources().get("CPU")})
"""

with DAG("k8s_ray_head_job", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    create = CreateRayClusterOperator(
        task_id="create_cluster", cluster_name="real-head", accelerator="v4", topology="2x2x2",
        cluster_options={"head_pod_template": {"spec": {"nodeSelector": {"cloud.google.com/gke-nodepool": HEAD_POOL}}}})
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name="real-head", timeout=240, poke_interval=1)
    job = SubmitRayJobOperator(task_id="job", cluster_name="real-head", entrypoint=["python", "-c", CODE],
                               deferrable=True, poll_interval=0.5)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name="real-head",
                                      wait_for_deletion=True, deletion_timeout=120, poll_interval=0.5)
    create >> ready >> job >> delete.as_teardown(setups=create)
'''


def test_a_job_through_the_service_proxy_reaches_the_real_head(
        airflow_home: Path, k8s_control_plane: ControlPlane, head_pool: str, namespace: str,
        connections: Connections, capfd: pytest.CaptureFixture[str]) -> None:
    cp = k8s_control_plane
    connections.as_role(documented_role())
    before = service_proxy_requests(cp)

    outcome = run_dag(airflow_home, JOB_DAG.replace("HEAD_POOL", repr(head_pool)), "k8s_ray_head_job")

    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "job": "success",
                               "delete_cluster": "success"}, outcome
    # The head pod's own `ray start --head` ran: one Ray node (the TPU hosts are virtual), its --num-cpus=2.
    assert outcome["job"].result == {"nodes": 1, "cpus": 2.0}
    log = capfd.readouterr().out
    assert log.count("[ray job] hello from the head pod") == 1
    # Ray's log tail, a WebSocket, was upgraded through the real API server's service proxy
    # (the trigger would have said it fell back to reading the whole log).
    assert "Ray's log stream of job" not in log, log
    after = service_proxy_requests(cp)
    proxied = {verb: after.get(verb, 0) - before.get(verb, 0) for verb in after}
    assert proxied.get("CONNECT", 0) >= 4, proxied  # package check, submit, status polls, logs
    wait_no_pods(cp, namespace)
    # Deleting the cluster stopped the head's processes: nothing serves the dashboard any more.
    (head_ip,) = host_pod_addresses(cp, namespace).values()
    assert not port_open(DASHBOARD_PORT, host=head_ip)


SERVICE_DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.rayservice import DeleteRayServiceOperator, DeployRayServiceOperator
from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

APPS = [{"name": "tiny", "import_path": "serving.model:build_app", "route_prefix": "/",
         "version_arg": "model_version",
         "deployments": [{"name": "TinyModel", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}]}]

with DAG("k8s_ray_head_service", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    deploy = DeployRayServiceOperator(
        task_id="deploy", service_name="tiny", applications=APPS, accelerator="v4", topology="2x2x2",
        version="v1", cluster_options={
            "env": {"PYTHONPATH": EXAMPLES},
            "head_pod_template": {"spec": {"nodeSelector": {"cloud.google.com/gke-nodepool": HEAD_POOL}}}})
    wait = RayServiceRunningSensor(
        task_id="wait_running", service_name="tiny", version="v1", timeout=300, poke_interval=1,
        smoke_request={"path": "/", "method": "POST", "json": {"inputs": [[0.1, 0.2, 0.3, 0.4]]}})
    delete = DeleteRayServiceOperator(task_id="delete_service", service_name="tiny", wait_for_deletion=True,
                                      deletion_timeout=120, poll_interval=0.5)
    deploy >> wait >> delete.as_teardown(setups=deploy)
"""


def test_a_rayservice_is_running_through_the_real_operator(
        airflow_home: Path, k8s_control_plane: ControlPlane, head_pool: str, namespace: str,
        connections: Connections) -> None:
    cp = k8s_control_plane
    connections.as_role(documented_role())
    source = SERVICE_DAG.replace("HEAD_POOL", repr(head_pool)).replace("EXAMPLES", repr(str(EXAMPLES)))

    outcome = run_dag(airflow_home, source, "k8s_ray_head_service")

    assert states(outcome) == {"deploy": "success", "wait_running": "success", "delete_service": "success"}, outcome
    running = outcome["wait_running"].result
    assert (running["phase"], running["active_version"]) == ("RUNNING", "v1"), running
    # The model on the real head answered through the API server's proxy to the Serve service.
    assert running["smoke"]["status"] == 200 and running["smoke"]["json"]["version"] == "v1"
    assert len(running["smoke"]["json"]["predictions"]) == 1
    wait_no_pods(cp, namespace)
    (head_ip,) = host_pod_addresses(cp, namespace).values()  # the service's one cluster's head
    assert not port_open(DASHBOARD_PORT, host=head_ip)
