"""docs/rbac.yaml is enough, and what it lacks is explained: the lifecycle DAG under a
ServiceAccount token bound to exactly that Role, then to a copy without ``delete``. And the Role is what
the provider calls, both ways: the API server's audit log of the whole tier against the Role."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane.audit import provider_requests
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import (
    DOCUMENTED_ROLE_USERS,
    Connections,
    NodePools,
    documented_role,
    lifecycle_dag,
    rayclusters,
    states,
    suffix,
    wait_no_pods,
)
from tests.controlplane.tpuwebhook import CONFIGURATION_NAME
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420)]

V4 = "tpu-v4-podslice"
GKE_DOCS = Path(__file__).resolve().parents[2] / "docs" / "gke.md"
#: What the provider may ask beyond the Role, each for a feature docs/gke.md lists under "Optional, per
#: feature": the CRD (in-place updates), and the connection test's webhook list, namespace read and reviews.
OPTIONAL = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "get"),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "list"),
    ("", "namespaces", "get"),
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
}


@pytest.fixture(scope="module")
def v4_nodes(module_node_pools: NodePools, head_nodes: list[str]) -> list[str]:
    """One v4 2x2x2 slice's worth of hosts (2 nodes of 4 chips)."""
    return module_node_pools.add("v4-rbac", tpu=V4, topology="2x2x2").nodes


def without_delete_on_rayclusters(role: dict[str, Any]) -> dict[str, Any]:
    """The same Role, except that ``delete`` on rayclusters is gone (other resources keep their verbs)."""
    role = copy.deepcopy(role)
    role["metadata"]["name"] += "-no-delete"
    rules = []
    for rule in role["rules"]:
        if "rayclusters" in rule.get("resources", []) and "delete" in rule["verbs"]:
            others = [r for r in rule["resources"] if r != "rayclusters"]
            if others:
                rules.append({**rule, "resources": others})
            rules.append({**rule, "resources": ["rayclusters"], "verbs": [v for v in rule["verbs"] if v != "delete"]})
        else:
            rules.append(rule)
    role["rules"] = rules
    return role


def assert_only_namespaced(cp: ControlPlane, token: str, namespace: str) -> None:
    """The token really is the restricted identity: no nodes, no other namespace."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    with cp.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        assert core.list_namespaced_pod(namespace).items is not None
        for forbidden in (core.list_node, lambda: core.list_namespaced_pod("default")):
            with pytest.raises(ApiException) as denied:
                forbidden()
            assert denied.value.status == 403


CREATE = {"cluster_name": "least-privilege", "accelerator": "v4", "topology": "2x2x2"}


def test_documented_role_runs_the_whole_lifecycle(airflow_home: Path, k8s_control_plane: ControlPlane,
                                                  v4_nodes: list[str], namespace: str,
                                                  connections: Connections) -> None:
    cp = k8s_control_plane
    token = connections.as_role(documented_role())
    assert_only_namespaced(cp, token, namespace)

    outcome = run_dag(airflow_home, lifecycle_dag("k8s_rbac_ok", create=CREATE), "k8s_rbac_ok")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    assert outcome["wait_ready"].result["ready_hosts"] == 2
    assert outcome["delete_cluster"].result["deleted"] is True
    assert rayclusters(cp, namespace) == []
    wait_no_pods(cp, namespace)


def test_role_without_delete_fails_the_delete_task_with_a_permission_error(
        airflow_home: Path, k8s_control_plane: ControlPlane, v4_nodes: list[str], namespace: str,
        connections: Connections, capfd: pytest.CaptureFixture[str]) -> None:
    cp = k8s_control_plane
    connections.as_role(without_delete_on_rayclusters(documented_role()))

    outcome = run_dag(airflow_home, lifecycle_dag("k8s_rbac_no_delete", create=CREATE), "k8s_rbac_no_delete")
    assert (outcome["create_cluster"].state, outcome["wait_ready"].state) == ("success", "success")
    # Not retried (retries=1 in the DAG): no retry can grant a permission.
    assert (outcome["delete_cluster"].state, outcome["delete_cluster"].try_number) == ("failed", 1)
    assert [rc["metadata"]["name"] for rc in rayclusters(cp, namespace)] == ["least-privilege"]

    log = capfd.readouterr().out
    failure = next((ln for ln in log.splitlines() if "may not delete rayclusters.ray.io" in ln), None)
    assert failure is not None, log[-5000:]
    assert f"in namespace '{namespace}'" in failure
    # The API server's own words, and the fix: the provider's Role.
    assert f'User "system:serviceaccount:{namespace}:' in failure and 'cannot delete resource "rayclusters"' in failure
    assert "Grant it the provider's Role" in failure and "'delete' on rayclusters.ray.io" in failure
    # The task fails with that message (a PermissionDeniedError, so not retried), not with a
    # traceback of the client's ApiException (ForbiddenException) and its HTTP headers.
    assert "PermissionDeniedError: The connection's Kubernetes identity may not delete rayclusters.ray.io" in log
    assert "AirflowFailException: The connection's Kubernetes identity may not delete rayclusters.ray.io" in log
    assert "kubernetes.client.exceptions" not in log and "ApiException" not in log
    assert "Reason: Forbidden" not in log and "HTTP response headers" not in log


def test_the_connection_test_reports_the_crd_the_tpu_webhook_and_missing_verbs(
        k8s_control_plane: ControlPlane, namespace: str, connections: Connections,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A line each: what the CRD says of KubeRay, whether GKE's TPU webhook (the stand-in) applies in the
    namespace, and which verbs of docs/rbac.yaml the identity lacks; none of them fails the test."""
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    cp = k8s_control_plane
    with_webhook = cp.create_namespace(f"rbac-webhook-{suffix()}", tpu_webhook=True)
    Connections(cp, with_webhook, monkeypatch).as_admin()
    ok, message = RayTpuHook().test_connection()
    assert ok, message
    lines = message.splitlines()
    assert lines[1] == ("KubeRay CRD rayclusters.ray.io: v1, v1alpha1, with upgradeStrategy, authOptions "
                        "(KubeRay 1.6 or newer)"), message
    assert lines[2] == f"GKE TPU webhook: {CONFIGURATION_NAME} mutates the TPU pods of namespace '{with_webhook}'"
    assert lines[3] == (f"RBAC in namespace '{with_webhook}': every verb of the provider's Role (docs/rbac.yaml) "
                        "is granted")

    connections.as_admin()  # a namespace the webhook's namespaceSelector leaves out
    ok, message = RayTpuHook().test_connection()
    assert ok, message
    assert f"{CONFIGURATION_NAME} exists, but its namespaceSelector leaves out namespace '{namespace}'" in message

    connections.as_role(without_delete_on_rayclusters(documented_role()))
    ok, message = RayTpuHook().test_connection()
    assert ok, message
    assert message.splitlines()[1:] == [
        "KubeRay CRD rayclusters.ray.io: not readable (403 Forbidden); KubeRay 1.5 features assumed",
        "GKE TPU webhook: cannot check: 403 Forbidden (listing mutatingwebhookconfigurations is cluster-wide)",
        f"RBAC in namespace '{namespace}': missing delete on rayclusters.ray.io (grant the provider's Role, "
        "docs/rbac.yaml)",
        f"This Airflow deployment records itself as {RayTpuHook().deployment!r}",
    ]



def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) for each permission the Role's rules grant."""
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def whole_tier_passed(session: pytest.Session) -> bool:
    """Every test of this directory was collected, none deselected, and none failed."""
    tier = {path.name for path in Path(__file__).parent.glob("test_*.py")}
    return ({item.path.name for item in session.items} >= tier and len(session.items) == session.testscollected
            and session.testsfailed == 0)


@pytest.mark.after_the_tier
def test_the_role_grants_what_the_provider_calls_and_nothing_more(k8s_control_plane: ControlPlane,
                                                                   request: pytest.FixtureRequest) -> None:
    """From the audit log of every test before this one: under exactly the Role, RBAC refused the provider
    only the optional features' requests; the provider (any identity) asked for nothing the Role and the
    optional features leave out; and, when the whole tier ran, for every permission the Role grants."""
    requests = provider_requests(k8s_control_plane)
    role = granted(documented_role())
    assert DOCUMENTED_ROLE_USERS, "no test ran under the Role"
    under_role = [r for r in requests if r.user in DOCUMENTED_ROLE_USERS]
    assert under_role, f"the audit log has no request of {sorted(DOCUMENTED_ROLE_USERS)}"
    refused = sorted({r.permission for r in under_role if r.refused} - OPTIONAL)
    assert refused == [], f"the Role lacks what the provider called: {refused}"

    used = {r.permission for r in requests}
    beyond = sorted(used - role - OPTIONAL)
    assert beyond == [], f"called, but neither in the Role nor among docs/gke.md's optional features: {beyond}"
    docs = GKE_DOCS.read_text()
    assert [resource for _, resource, _ in OPTIONAL if f"`{resource}`" not in docs] == []
    if not whole_tier_passed(request.session):
        pytest.skip("the whole tier did not run and pass: which permissions went unused cannot be told")
    assert sorted(role - used) == [], "the Role grants what the provider never called"
    assert sorted(OPTIONAL - used) == []
