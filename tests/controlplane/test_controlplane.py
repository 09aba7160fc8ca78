"""The real control plane + real KubeRay operator schedule a multi-host TPU
RayCluster onto fake GKE TPU nodes, report it ready, and clean up on delete."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest

from tests.controlplane.support import NodePools, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600)]

RAY_IMAGE = "rayproject/ray:2.60.0"
ACCELERATOR = "tpu-v6e-slice"
TOPOLOGY = "4x4"


def tpu_raycluster(name: str) -> dict[str, Any]:
    tpu = {"google.com/tpu": "4", "cpu": "1", "memory": "4Gi"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{
                    "name": "ray-head", "image": RAY_IMAGE,
                    "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                                  "limits": {"cpu": "1", "memory": "2Gi"}},
                }]}},
            },
            "workerGroupSpecs": [{
                "groupName": "tpu-v6e-4x4",
                "replicas": 2, "minReplicas": 2, "maxReplicas": 2, "numOfHosts": 4,
                "rayStartParams": {},
                "template": {"spec": {
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": ACCELERATOR,
                                     "cloud.google.com/gke-tpu-topology": TOPOLOGY},
                    "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "ray-worker", "image": RAY_IMAGE,
                        "resources": {"requests": dict(tpu), "limits": dict(tpu)},
                    }],
                }},
            }],
        },
    }


def _ready(pod) -> bool:
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_tpu_raycluster_on_real_control_plane(k8s_control_plane, head_nodes: list[str], node_pools: NodePools,
                                              namespace: str):
    from kubernetes import client

    cp = k8s_control_plane
    t0 = time.monotonic()
    cpu_nodes = head_nodes
    tpu_nodes = node_pools.add("v6e", tpu=ACCELERATOR, topology=TOPOLOGY, num_nodes=8).nodes
    assert len(tpu_nodes) == 8
    ns = namespace
    name = "tpu-v6e-4x4"

    with cp.api_client() as api:
        core = client.CoreV1Api(api)
        crd = client.CustomObjectsApi(api)

        node = core.read_node(tpu_nodes[0])
        assert node.metadata.labels["cloud.google.com/gke-tpu-accelerator"] == ACCELERATOR
        assert node.status.allocatable["google.com/tpu"] == "4"
        assert any(t.key == "google.com/tpu" and t.effect == "NoSchedule" for t in node.spec.taints)

        crd.create_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", tpu_raycluster(name))
        selector = f"ray.io/cluster={name}"

        def all_running():
            pods = core.list_namespaced_pod(ns, label_selector=selector).items
            return pods if len(pods) == 9 and all(_ready(p) for p in pods) else None

        pods = wait_for(all_running, 120, "1 head + 8 worker pods Running and Ready")
        t_running = time.monotonic() - t0

        heads = [p for p in pods if p.metadata.labels.get("ray.io/node-type") == "head"]
        workers = [p for p in pods if p.metadata.labels.get("ray.io/node-type") == "worker"]
        assert len(heads) == 1 and len(workers) == 8
        assert heads[0].spec.node_name in cpu_nodes
        assert all(p.spec.node_name in tpu_nodes for p in workers)
        # 4 chips per host, one TPU pod per TPU node.
        assert len({p.spec.node_name for p in workers}) == 8
        assert all(p.status.pod_ip for p in pods)

        slices = collections.defaultdict(list)
        for p in workers:
            slices[p.metadata.labels["ray.io/worker-group-replica-index"]].append(p)
        assert sorted(slices) == ["0", "1"], slices.keys()
        for members in slices.values():
            assert len(members) == 4
            assert sorted(p.metadata.labels["ray.io/replica-host-index"] for p in members) == ["0", "1", "2", "3"]
            assert len({p.metadata.labels["ray.io/worker-group-replica-name"] for p in members}) == 1

        def cluster_ready():
            rc = crd.get_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", name)
            st = rc.get("status", {})
            conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
            ok = (st.get("readyWorkerReplicas") == 8 and st.get("desiredWorkerReplicas") == 8
                  and conds.get("HeadPodReady") == "True")
            return st if ok else None

        status = wait_for(cluster_ready, 60, "RayCluster readyWorkerReplicas == desiredWorkerReplicas == 8")
        t_ready = time.monotonic() - t0
        conds = {c["type"]: c["status"] for c in status["conditions"]}
        assert conds.get("RayClusterProvisioned") == "True"
        assert status.get("head", {}).get("podIP") == heads[0].status.pod_ip

        # Delete: the garbage collector (kube-controller-manager) removes the
        # pods, the virtual kubelet confirms their termination.
        crd.delete_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", name)
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=selector).items,
                 90, "all pods of the deleted RayCluster gone")
        wait_for(lambda: not [s for s in core.list_namespaced_service(ns).items
                              if s.metadata.labels and s.metadata.labels.get("ray.io/cluster") == name],
                 60, "the RayCluster's services gone")
        t_deleted = time.monotonic() - t0
        print(f"\n[k8s] pods running {t_running:.1f}s, RayCluster ready {t_ready:.1f}s, "
              f"deleted+collected {t_deleted:.1f}s")


def test_tpu_node_preemption_recreates_whole_slice(k8s_control_plane, head_nodes: list[str], node_pools: NodePools,
                                                   namespace: str):
    """Deleting a TPU node (a GKE preemption) fails its pod; KubeRay
    (RayMultiHostIndexing) recreates the whole slice, which waits Pending for
    a replacement node and becomes ready again once one is added."""
    cp = k8s_control_plane
    pool, tpu_nodes = node_pools.add("v6e-p", tpu=ACCELERATOR, topology=TOPOLOGY)  # one slice: 4 hosts
    assert len(tpu_nodes) == 4
    ns = namespace
    name = "one-slice"
    rc = tpu_raycluster(name)
    group = rc["spec"]["workerGroupSpecs"][0]
    group.update(replicas=1, minReplicas=1, maxReplicas=1)
    # Pin to this test's pool: other tests' v6e 4x4 nodes must not take the
    # recreated pods.
    group["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] = pool
    _check_preemption(cp, ns, name, rc, pool, tpu_nodes)


def _check_preemption(cp, ns: str, name: str, rc: dict, pool: str, tpu_nodes: list[str]) -> None:
    from kubernetes import client


    with cp.api_client() as api:
        core = client.CoreV1Api(api)
        crd = client.CustomObjectsApi(api)
        crd.create_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", rc)

        def workers():
            return core.list_namespaced_pod(ns, label_selector=f"ray.io/cluster={name},ray.io/node-type=worker").items

        def ready_workers():
            st = crd.get_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", name).get("status", {})
            return st.get("readyWorkerReplicas")

        before = wait_for(lambda: (ws := workers()) and len(ws) == 4 and all(_ready(p) for p in ws) and ws,
                          120, "4 Ready workers")
        wait_for(lambda: ready_workers() == 4, 60, "readyWorkerReplicas == 4")
        old_names = {p.metadata.name for p in before}
        victim = tpu_nodes[1]

        cp.delete_node(victim)

        def slice_recreated():
            ws = [p for p in workers() if p.metadata.deletion_timestamp is None]
            names = {p.metadata.name for p in ws}
            if len(ws) != 4 or names & old_names:
                return None
            running = [p for p in ws if _ready(p)]
            pending = [p for p in ws if p.status.phase == "Pending" and not p.spec.node_name]
            return ws if len(running) == 3 and len(pending) == 1 else None

        recreated = wait_for(slice_recreated, 60, "the whole slice recreated: 3 Running + 1 Pending")
        assert all(p.spec.node_name != victim for p in recreated)
        wait_for(lambda: ready_workers() == 3, 30, "readyWorkerReplicas == 3")

        replacement = cp.add_node_pool(pool, tpu=ACCELERATOR, topology=TOPOLOGY, num_nodes=1)
        final = wait_for(lambda: (ws := workers()) and len(ws) == 4 and all(_ready(p) for p in ws) and ws,
                         60, "4 Ready workers after the replacement node joined")
        assert replacement[0] in {p.spec.node_name for p in final}
        assert len({p.metadata.labels["ray.io/worker-group-replica-index"] for p in final}) == 1
        wait_for(lambda: ready_workers() == 4, 30, "readyWorkerReplicas == 4 again")

        crd.delete_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", name)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "pods collected")


def test_service_account_tokens_and_rbac(k8s_control_plane, namespace: str):
    """RBAC is real: a fresh ServiceAccount token is denied until bound."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    cp = k8s_control_plane
    ns = namespace
    token = cp.token_for("reader", ns)
    with cp.api_client(token=token) as api:
        with pytest.raises(ApiException) as err:
            client.CoreV1Api(api).list_namespaced_pod(ns)
        assert err.value.status == 403
    token = cp.token_for("reader", ns, cluster_role="view")
    with cp.api_client(token=token) as api:
        assert client.CoreV1Api(api).list_namespaced_pod(ns).items == []

    kc = cp.kubeconfig_dict()
    assert kc["clusters"][0]["cluster"]["server"] == cp.server
    assert kc["users"][0]["user"]["token"] == cp.admin_token
    assert cp.kubeconfig_path.is_file() and cp.ca_path.is_file()
