"""What the k8s integration modules share: connections, node pools, DAG sources, waits.

The DAGs run with ``dag.test()`` (tests/support/airflow_runner.py) and talk to the real API
server of the session's :class:`~tests.controlplane.controlplane.ControlPlane` through a
``raytpu`` connection of backend ``kubernetes`` -> a cncf-kubernetes connection whose
``kube_config`` extra is a kubeconfig (CA embedded) for some identity.
:class:`Connections` and :class:`NodePools` are what the fixtures of conftest.py hand out.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from tests.controlplane.controlplane import ControlPlane

KUBE_CONN_ID = "kube_test"
V6E = "tpu-v6e-slice"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
REPLICA_INDEX = "ray.io/worker-group-replica-index"
REPLICA_NAME = "ray.io/worker-group-replica-name"
HOST_INDEX = "ray.io/replica-host-index"
RBAC_YAML = Path(__file__).resolve().parents[2] / "docs" / "rbac.yaml"
SA = "airflow-worker"


def suffix() -> str:
    return uuid.uuid4().hex[:6]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


# -- connections ---------------------------------------------------------------------------------


def kube_connection(kubeconfig: dict[str, Any], namespace: str) -> str:
    """A cncf-kubernetes connection (``AIRFLOW_CONN_<ID>`` JSON) with ``kubeconfig`` inline."""
    return json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(kubeconfig),
                                                            "namespace": namespace}})


def raytpu_connection(namespace: str, kubernetes_conn_id: str = KUBE_CONN_ID, *, confirm_with_ray: bool) -> str:
    return json.dumps({"conn_type": "raytpu", "extra": {"backend": "kubernetes",
                                                        "kubernetes_conn_id": kubernetes_conn_id,
                                                        "namespace": namespace,
                                                        "confirm_with_ray": confirm_with_ray}})


def kubeconfig_for(server: str, ca_pem: bytes, token: str, namespace: str = "default") -> dict[str, Any]:
    """A token kubeconfig for ``server`` trusting ``ca_pem`` (e.g. a proxy with its own CA)."""
    import base64

    return {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server,
                                                 "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
        "current-context": "c",
    }


# -- identities ---------------------------------------------------------------------------------


#: The ServiceAccounts bound to exactly docs/rbac.yaml's Role in this session, as the audit log names them.
DOCUMENTED_ROLE_USERS: set[str] = set()


def documented_role() -> dict[str, Any]:
    """The least-privilege Role the docs give users (docs/rbac.yaml)."""
    role = yaml.safe_load(RBAC_YAML.read_text())
    assert role["kind"] == "Role" and role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    return role


def bind(cp: ControlPlane, namespace: str, role: dict[str, Any]) -> str:
    """Create ``role`` in ``namespace``, bind it (RoleBinding) to a fresh ServiceAccount; its token."""
    from kubernetes import client

    sa = f"{SA}-{suffix()}"
    token = cp.token_for(sa, namespace)  # creates the ServiceAccount; no cluster-wide binding
    with cp.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(namespace, role)
        rbac.create_namespaced_role_binding(namespace, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": f"{role['metadata']['name']}-{sa}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        })
    if role["rules"] == documented_role()["rules"]:
        DOCUMENTED_ROLE_USERS.add(f"system:serviceaccount:{namespace}:{sa}")
    return token


class Connections:
    """Points ``raytpu_default`` (backend kubernetes) -> ``kube_test`` at one namespace, as some identity.

    :param confirm_with_ray: the connection's ``confirm_with_ray``: on only where every pod of the test's
        clusters runs Ray (nodes with ``host_processes``) and GKE's TPU webhook stand-in mutates them
        (``create_namespace(..., tpu_webhook=True)``); elsewhere the pods run nothing to confirm with.
    """

    def __init__(self, cp: ControlPlane, namespace: str, monkeypatch: pytest.MonkeyPatch, *,
                 confirm_with_ray: bool = False) -> None:
        self.cp = cp
        self.namespace = namespace
        self._monkeypatch = monkeypatch
        self.confirm_with_ray = confirm_with_ray

    def use(self, kubeconfig: dict[str, Any]) -> None:
        """``raytpu_default`` (backend kubernetes, the namespace) -> ``kube_test`` -> ``kubeconfig``
        (e.g. one for a proxy in front of the API server)."""
        self._monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube_connection(kubeconfig, self.namespace))
        self._monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT",
                                 raytpu_connection(self.namespace, confirm_with_ray=self.confirm_with_ray))

    def as_admin(self) -> None:
        self.use(self.cp.kubeconfig_dict(namespace=self.namespace))

    def as_role(self, role: dict[str, Any]) -> str:
        """Connect as a fresh ServiceAccount bound (RoleBinding) to ``role`` in the namespace; its token."""
        token = bind(self.cp, self.namespace, role)
        self.use(self.cp.kubeconfig_dict(token=token, user=SA, namespace=self.namespace))
        return token


@contextlib.contextmanager
def ray_namespace(cp: ControlPlane, prefix: str) -> Iterator[str]:
    """A namespace where every pod runs Ray: GKE's TPU webhook on, ``raytpu_default`` -> it as admin,
    READY confirmed with Ray. The RayServices and RayClusters a failed test left are deleted after."""
    ns = cp.create_namespace(f"{prefix}-{suffix()}", tpu_webhook=True)
    patch = pytest.MonkeyPatch()
    Connections(cp, ns, patch, confirm_with_ray=True).as_admin()
    try:
        yield ns
    finally:
        with contextlib.suppress(Exception):
            status, services = get_json(cp, f"/apis/ray.io/v1/namespaces/{ns}/rayservices")
            for service in services["items"] if status == 200 else []:
                cp.request("DELETE", f"/apis/ray.io/v1/namespaces/{ns}/rayservices/{service['metadata']['name']}")
            force_delete_clusters(cp, ns)
        patch.undo()


# -- node pools ----------------------------------------------------------------------------------


class NodePool(NamedTuple):
    name: str
    nodes: list[str]


class NodePools:
    """The node pools of one test or module, under fresh names; :meth:`delete_all` removes them."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.names: list[str] = []

    def name(self, prefix: str) -> str:
        """A fresh pool name ``<prefix>-<6 hex>``, deleted with the others: for a pool added later
        (``cp.add_node_pool(name, ...)``, also to grow a pool after a preemption)."""
        name = f"{prefix}-{suffix()}"
        self.names.append(name)
        return name

    def add(self, prefix: str, **options: Any) -> NodePool:
        """``cp.add_node_pool`` (same options) under a fresh name."""
        name = self.name(prefix)
        return NodePool(name, self.cp.add_node_pool(name, **options))

    def delete_all(self) -> None:
        for name in self.names:
            with contextlib.suppress(Exception):
                self.cp.delete_node_pool(name)


# -- reading the cluster -------------------------------------------------------------------------


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def list_pods(cp: ControlPlane, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    status, body = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods"
                              + (f"?labelSelector={selector}" if selector else ""))
    assert status == 200, body
    return json.loads(body)["items"]


def get_json(cp: ControlPlane, path: str) -> tuple[int, dict[str, Any]]:
    status, body = cp.request("GET", path)
    return status, json.loads(body) if body else {}


def ray_token(cp: ControlPlane, namespace: str, cluster: str) -> str:
    """The Ray token of a RayCluster, from the Secret KubeRay made for it (``authOptions.mode: token``)."""
    status, secret = get_json(cp, f"/api/v1/namespaces/{namespace}/secrets/{cluster}")
    assert status == 200, secret
    return base64.b64decode(secret["data"]["auth_token"]).decode()


def dashboard_get(cp: ControlPlane, namespace: str, cluster: str, path: str,
                  token: str | None = None) -> tuple[int, bytes]:
    """GET ``path`` of a RayCluster's dashboard through the API server's service proxy, with the cluster's
    Ray token (``token``: another one; ``""``: none) where Ray's own header says it."""
    token = ray_token(cp, namespace, cluster) if token is None else token
    return cp.request("GET", f"/api/v1/namespaces/{namespace}/services/{cluster}-head-svc:dashboard/proxy{path}",
                      timeout=60, headers={"X-Ray-Authorization": f"Bearer {token}"} if token else {})


def rayclusters(cp: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    status, body = get_json(cp, f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters")
    assert status == 200, body
    return body["items"]


def wait_no_pods(cp: ControlPlane, namespace: str, timeout: float = 90) -> None:
    """The garbage collector removed the deleted RayCluster's pods (the virtual kubelet confirms)."""
    wait_for(lambda: not list_pods(cp, namespace), timeout, f"no pod left in {namespace}", interval=0.5)


def host_pod_addresses(cp: ControlPlane, namespace: str) -> dict[str, str]:
    """``pod name -> IP`` of every pod in ``namespace`` whose containers the virtual kubelet ran here."""
    assert cp.kubelet is not None
    found = {}
    for action, what in cp.kubelet.events:
        if action == "started host processes" and what.startswith(f"{namespace}/"):
            key, _, rest = what.partition(" at ")
            found[key.split("/", 1)[1]] = rest.split(" ", 1)[0]
    return found


def force_delete_clusters(cp: ControlPlane, namespace: str) -> None:
    """Cleanup with the admin identity (a test that failed half-way)."""
    for rc in rayclusters(cp, namespace):
        cp.request("DELETE", f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters/{rc['metadata']['name']}")


# -- DAG sources ---------------------------------------------------------------------------------

_SNAPSHOT_TASK = '''
    @task
    def snapshot(reference):
        """The cluster's pods as the connection's identity sees them, at the moment it is ready."""
        from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

        pods = RayTpuHook().backend.cluster_pods(reference["cluster_name"], reference["namespace"])
        return [{"name": p["metadata"]["name"], "labels": p["metadata"].get("labels") or {},
                 "node": p["spec"].get("nodeName"), "phase": p["status"].get("phase"),
                 "ready": any(c["type"] == "Ready" and c["status"] == "True"
                              for c in p["status"].get("conditions") or [])} for p in pods]

    snap = snapshot(create.output)
    ready >> snap >> delete
'''

_GATE_TASK = '''
    @task
    def wait_unschedulable(reference, hosts):
        """Test scaffolding: let the real scheduler reject every TPU host pod before the sensor starts."""
        import time
        from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

        backend = RayTpuHook().backend
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            pods = [p for p in backend.cluster_pods(reference["cluster_name"], reference["namespace"])
                    if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]
            rejected = [p for p in pods if any(c["type"] == "PodScheduled" and c["status"] == "False"
                                               and c.get("reason") == "Unschedulable"
                                               for c in p["status"].get("conditions") or [])]
            if len(rejected) == hosts:
                return sorted(p["metadata"]["name"] for p in rejected)
            time.sleep(0.5)
        raise RuntimeError(f"TPU host pods not all rejected by the scheduler: {{pods}}")

    gate = wait_unschedulable(create.output, {hosts})
    gate >> ready
'''


def lifecycle_dag(
    dag_id: str,
    *,
    create: dict[str, Any],
    sensor_timeout: float = 240,
    snapshot: bool = False,
    gate_unschedulable_hosts: int | None = None,
    retries: int = 1,
    delete: bool = True,
    sensor: dict[str, Any] | None = None,
) -> str:
    """A create -> wait_ready (deferrable) -> delete (teardown, wait_for_deletion) DAG.

    :param create: CreateRayClusterOperator keyword arguments (rendered with ``repr``).
    :param sensor: more RayClusterReadySensor keyword arguments (rendered with ``repr``).
    :param snapshot: add a task between ready and delete returning the cluster's pods.
    :param gate_unschedulable_hosts: add a task before the sensor that waits until that
        many TPU host pods were rejected by the scheduler.
    :param delete: add the delete teardown.
    """
    from airflow_provider_raytpu.manifests.options import OPTION_NAMES

    options = {k: v for k, v in create.items() if k in OPTION_NAMES}  # given one way: cluster_options
    create = {**{k: v for k, v in create.items() if k not in OPTION_NAMES},
              **({"cluster_options": {**create.get("cluster_options", {}), **options}} if options else {})}
    args = ", ".join(f"{k}={v!r}" for k, v in create.items())
    sensor_args = "".join(f", {k}={v!r}" for k, v in (sensor or {}).items())
    lines = [
        "from datetime import datetime",
        "from airflow.sdk import DAG, task",
        "from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator",
        "from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor",
        "",
        f"with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1),",
        f"         default_args={{'retries': {retries}, 'retry_delay': 0}}):",
        f"    create = CreateRayClusterOperator(task_id='create_cluster', {args})",
        "    cluster = \"{{ ti.xcom_pull('create_cluster')['cluster_name'] }}\"",
        f"    ready = RayClusterReadySensor(task_id='wait_ready', cluster_name=cluster, timeout={sensor_timeout},"
        f" poke_interval=1{sensor_args})",
        "    create >> ready",
    ]
    if delete:
        lines += [
            "    delete = DeleteRayClusterOperator(task_id='delete_cluster', cluster_name=cluster,",
            "                                      wait_for_deletion=True, deletion_timeout=120, poll_interval=0.5)",
            "    ready >> delete.as_teardown(setups=create)",
        ]
    source = "\n".join(lines) + "\n"
    if snapshot:
        assert delete
        source += _SNAPSHOT_TASK
    if gate_unschedulable_hosts is not None:
        source += _GATE_TASK.replace("{hosts}", str(gate_unschedulable_hosts)).replace("{{pods}}", "{pods}")
    return source


def ready_delete_dag(dag_id: str, cluster_name: str, sensor_timeout: float = 240) -> str:
    """wait_ready (deferrable) -> delete (wait_for_deletion), for a cluster another DAG made (so ``force``)."""
    return f"""
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), default_args={{'retries': 0}}):
    ready = RayClusterReadySensor(task_id='wait_ready', cluster_name={cluster_name!r}, timeout={sensor_timeout},
                                  poke_interval=1)
    delete = DeleteRayClusterOperator(task_id='delete_cluster', cluster_name={cluster_name!r}, force=True,
                                      wait_for_deletion=True, deletion_timeout=120, poll_interval=0.5)
    ready >> delete
"""


def states(outcome: dict[str, Any]) -> dict[str, str]:
    return {task: o.state for task, o in outcome.items()}
