"""The lifecycle DAG through a fault-injecting proxy in front of the real API server:
503s, 429 with Retry-After, a lost create answer, a watch cut mid-stream. Create and
delete retry without duplicates; the sensor's watch resumes and still fires."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.faultproxy import FaultProxy, seen_summary
from tests.controlplane.support import (
    NODEPOOL_LABEL,
    Connections,
    NodePools,
    kubeconfig_for,
    lifecycle_dag,
    rayclusters,
    states,
    wait_no_pods,
)
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420)]

V4 = "tpu-v4-podslice"
CLUSTER = "flaky"


def test_lifecycle_survives_api_faults(airflow_home: Path, k8s_control_plane: ControlPlane, head_nodes: list[str],
                                       node_pools: NodePools, namespace: str, connections: Connections,
                                       capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    cp = k8s_control_plane
    ns = namespace
    pool = node_pools.name("v4-faults")  # added once the watch was cut and resumed
    collection = rf"^/apis/ray\.io/v1/namespaces/{ns}/rayclusters$"
    item = rf"^/apis/ray\.io/v1/namespaces/{ns}/rayclusters/{CLUSTER}$"

    with FaultProxy(cp.server, cp.ca_path, tls=True) as proxy:
        proxy.inject("answer", "GET", item, watch=False, status=503)       # the read before create
        proxy.inject("answer", "POST", collection, status=503)
        proxy.inject("answer", "POST", collection, status=429, retry_after=1)
        proxy.inject("lose", "POST", collection, status=503)              # created, but the answer is lost
        proxy.inject("cut", "GET", collection, watch=True)                # the trigger's watch, cut mid-stream
        proxy.inject("answer", "GET", collection, watch=True, status=503)  # its first resumption refused
        proxy.inject("answer", "DELETE", item, status=503)
        proxy.inject("answer", "DELETE", item, status=429, retry_after=1)
        # TLS toward the client too, with the proxy's own CA in the kubeconfig.
        connections.use(kubeconfig_for(proxy.url, proxy.ca_pem or b"", cp.admin_token, ns))

        def watches(**kw: object) -> list:
            return proxy.seen("GET", collection, watch=True, **kw)

        helper_errors: list[BaseException] = []

        def release_nodes_after_the_cut() -> None:
            """The TPU hosts' node pool appears only once the watch was cut and resumed,
            so the cluster cannot be ready before (no timing involved)."""
            try:
                proxy.wait_until(lambda: watches(forwarded=True), 180, "the trigger's first watch")
                # An event on that watch: the proxy passes its first chunk, then cuts the stream.
                status, body = cp.request(
                    "PATCH", f"/apis/ray.io/v1/namespaces/{ns}/rayclusters/{CLUSTER}",
                    json.dumps({"metadata": {"labels": {"raytpu.test/poke": "1"}}}).encode(),
                    content_type="application/merge-patch+json")
                assert status == 200, body
                proxy.wait_until(lambda: len(watches(forwarded=True)) >= 2, 120, "the watch resumed after the cut")
                cp.add_node_pool(pool, tpu=V4, topology="2x2x2")
            except BaseException as exc:  # reported by the test
                helper_errors.append(exc)

        helper = threading.Thread(target=release_nodes_after_the_cut, name="release-nodes", daemon=True)
        helper.start()
        create = {"cluster_name": CLUSTER, "accelerator": "v4", "topology": "2x2x2",
                  "worker_pod_template": {"spec": {"nodeSelector": {NODEPOOL_LABEL: pool}}}}
        outcome = run_dag(airflow_home, lifecycle_dag("k8s_faults", create=create), "k8s_faults")
        helper.join(30)
        # Task logs go to stdout; the inline trigger's may go to Python logging instead.
        log = capfd.readouterr().out + caplog.text
        requests = seen_summary(proxy.seen())

    assert not helper_errors, helper_errors
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}, \
        requests
    # No retry of Airflow's own: the provider's API retries absorbed every fault.
    assert all(o.try_number == 1 for o in outcome.values()), outcome

    # Create: 503, 429 (+ Retry-After), a lost answer, then 409 -> adopted. One RayCluster was made.
    posts = proxy.seen("POST", collection)
    assert [p.fault for p in posts] == ["answer 503", "answer 429", "lose 503", None], requests
    assert [p.status for p in posts if p.forwarded] == [201, 409], requests
    assert all(p.query.get("fieldValidation") == "Strict" for p in posts)
    assert f"RayCluster {ns}/{CLUSTER} adopted" in log

    # The sensor deferred; its watch was cut mid-stream, a resumption was refused, and it
    # resumed from the resourceVersion it had reached; then it fired READY.
    ready = outcome["wait_ready"].result
    assert (ready["phase"], ready["ready_hosts"]) == ("READY", 2)
    seen_watches = watches()
    assert [w.fault for w in seen_watches[:2]] == ["cut", "answer 503"], requests
    resumed = [w for w in watches(forwarded=True) if w.query.get("resourceVersion")]
    assert len(resumed) >= 2, requests
    # Resumed, not re-listed: from the same or a later resourceVersion (events after it are replayed).
    assert int(resumed[1].query["resourceVersion"]) >= int(resumed[0].query["resourceVersion"]), requests
    assert f"Watch of RayClusters in {ns} dropped" in log and f"Watch of RayClusters in {ns} failed (503)" in log
    assert not any(w.query.get("fieldSelector") for w in seen_watches), "one watch per namespace, for every wait on it"

    # Delete: 503, 429 (+ Retry-After), then deleted once.
    deletes = proxy.seen("DELETE", item)
    assert [d.fault for d in deletes] == ["answer 503", "answer 429", None], requests
    assert [d.status for d in deletes if d.forwarded] == [200]
    assert outcome["delete_cluster"].result["deleted"] is True
    assert rayclusters(cp, ns) == []
    wait_no_pods(cp, ns)
    assert not proxy.errors, proxy.errors


def test_plain_http_proxy_and_a_throttled_list(k8s_control_plane: ControlPlane, namespace: str,
                                               connections: Connections) -> None:
    """The proxy's plain-HTTP mode; the connection test (list RayClusters) retries a 429."""
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    cp = k8s_control_plane
    ns = namespace
    collection = rf"^/apis/ray\.io/v1/namespaces/{ns}/rayclusters$"
    with FaultProxy(cp.server, cp.ca_path, tls=False) as proxy:
        assert proxy.url.startswith("http://")
        proxy.inject("answer", "GET", collection, status=429, retry_after=0)
        kubeconfig = cp.kubeconfig_dict(namespace=ns)
        kubeconfig["clusters"] = [{"name": "raytpu-test", "cluster": {"server": proxy.url}}]
        connections.use(kubeconfig)
        ok, message = RayTpuHook().test_connection()
        assert ok, message
        assert f"Reached {proxy.url}" in message and "0 made by this provider" in message
        listed = [(r.fault, r.status) for r in proxy.seen("GET", collection)]  # the Test lists them twice
        assert listed == [("answer 429", None), (None, 200), (None, 200)], listed
        assert not proxy.errors, proxy.errors
