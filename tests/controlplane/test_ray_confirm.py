"""READY confirmed by Ray, and the GKE TPU webhook diagnosed, on the real control plane.

A v4 2x2x2 slice is two hosts of 4 chips: on nodes whose pods really run (tests/controlplane/hostpods.py), each
host pod runs its own raylet, which detects its TPU the way it does on GKE, from what the TPU device
plugin (tests/controlplane/tpuenv.py) and GKE's TPU webhook (tests/controlplane/tpuwebhook.py) put in the pod. The
sensor reads Ray's node list through the API server's service proxy, as in production.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import (
    NODEPOOL_LABEL,
    V6E,
    Connections,
    NodePools,
    dashboard_get,
    force_delete_clusters,
    get_json,
    lifecycle_dag,
    list_pods,
    states,
    suffix,
    wait_for,
)
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600)]

V4 = "tpu-v4-podslice"


@pytest.fixture(scope="module")
def cp(networked_control_plane: ControlPlane) -> ControlPlane:
    return networked_control_plane


@pytest.fixture(scope="module")
def pools(cp: ControlPlane, module_node_pools: NodePools) -> dict[str, str]:
    """Pods that run: a CPU node for the Ray heads and one v4 2x2x2 slice (2 hosts); pods that only report
    running: a CPU node and one v6e 4x4 slice (4 hosts)."""
    return {
        "heads": module_node_pools.add("confirm-heads", cpu_nodes=1, host_processes=True).name,
        "v4": module_node_pools.add("confirm-v4", tpu=V4, topology="2x2x2", host_processes=True).name,
        "idle_heads": module_node_pools.add("idle-heads", cpu_nodes=1).name,
        "v6e": module_node_pools.add("idle-v6e", tpu=V6E, topology="4x4").name,
    }


def on(pool: str) -> dict[str, dict[str, dict[str, str]]]:
    return {"spec": {"nodeSelector": {NODEPOOL_LABEL: pool}}}


def webhook_namespace(cp: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> str:
    ns = cp.create_namespace(f"ray-confirm-{suffix()}", tpu_webhook=True)
    Connections(cp, ns, monkeypatch, confirm_with_ray=True).as_admin()
    return ns


def test_without_the_tpu_webhook_the_sensor_fails_at_once_saying_so(
        airflow_home: Path, cp: ControlPlane, pools: dict[str, str], namespace: str,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    Connections(cp, namespace, monkeypatch, confirm_with_ray=True).as_admin()
    source = lifecycle_dag("k8s_no_webhook", create={"cluster_name": "bare", "accelerator": "v6e", "topology": "4x4",
                                                     "head_pod_template": on(pools["idle_heads"])},
                           sensor_timeout=300, retries=0)
    started = time.monotonic()
    outcome = run_dag(airflow_home, source, "k8s_no_webhook")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "failed", "delete_cluster": "success"}
    assert outcome["wait_ready"].try_number == 1
    assert time.monotonic() - started < 240, "failed at once, not at the sensor's timeout"
    log = capfd.readouterr().out
    assert "AirflowSensorTimeout" not in log
    assert "the GKE TPU webhook did not mutate these pods: slice 0 (pod bare-" in log
    assert "have no TPU_WORKER_ID or TPU_WORKER_HOSTNAMES, so Ray cannot group their hosts into slices" in log
    assert "kubectl get mutatingwebhookconfigurations" in log


def test_ready_once_ray_lists_the_slice_with_its_head_and_chips(
        airflow_home: Path, cp: ControlPlane, pools: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    ns = webhook_namespace(cp, monkeypatch)
    try:
        source = lifecycle_dag("k8s_ray_confirms", create={"cluster_name": "slice", "accelerator": "v4",
                                                           "topology": "2x2x2",
                                                           "head_pod_template": on(pools["heads"])},
                               retries=0, delete=False)
        outcome = run_dag(airflow_home, source, "k8s_ray_confirms")
        assert states(outcome) == {"create_cluster": "success", "wait_ready": "success"}, outcome
        ready = outcome["wait_ready"].result
        assert (ready["phase"], ready["ready_hosts"], ready["ray_hosts"]) == ("READY", 2, 2)
        assert ready["message"].endswith(
            "Ray lists 2 of 2 TPU hosts with their chips and slice, one slice head per slice")

        # The sensor read Ray's node list with the cluster's token: KubeRay turned on Ray's token
        # authentication (authOptions), and the real head refuses a request without it or with another.
        _, cluster = get_json(cp, f"/apis/ray.io/v1/namespaces/{ns}/rayclusters/slice")
        assert cluster["spec"]["authOptions"] == {"mode": "token"}
        path = "/api/v0/nodes?" + quote("limit=100&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE",
                                        safe="=&%")
        assert dashboard_get(cp, ns, "slice", path, token="")[0] == 401
        assert dashboard_get(cp, ns, "slice", path, token="not-the-token")[0] == 403
        # What the sensor read, read again: the real raylets' resources and labels.
        status, body = dashboard_get(cp, ns, "slice", path)
        assert status == 200, body
        answer = json.loads(body)
        workers = [n for n in answer["data"]["result"]["result"] if not n["is_head_node"]]
        assert [n["resources_total"]["TPU"] for n in workers] == [4.0, 4.0]
        assert len({n["labels"]["ray.io/tpu-slice-name"] for n in workers}) == 1
        assert sorted(n["labels"]["ray.io/tpu-worker-id"] for n in workers) == ["0", "1"]
        assert sum("TPU-v4-16-head" in n["resources_total"] for n in workers) == 1

        # A worker container that exits (ray start gives up after 30 s on a busy machine) is started again,
        # as a kubelet does: the pod is not ready meanwhile, then ready with one restart, and Ray lists it.
        name = min(p["metadata"]["name"] for p in list_pods(cp, ns, "ray.io/cluster=slice,ray.io/node-type=worker"))
        assert cp.kubelet is not None
        host_pod = cp.kubelet.host_pod(ns, name)
        assert host_pod is not None and host_pod.main_pid is not None
        os.kill(host_pod.main_pid, signal.SIGKILL)

        def container() -> dict[str, Any]:
            return get_json(cp, f"/api/v1/namespaces/{ns}/pods/{name}")[1]["status"]["containerStatuses"][0]

        wait_for(lambda: not container()["ready"], 30, f"{name} not ready")
        wait_for(lambda: container()["ready"] and container()["restartCount"] == 1, 180, f"{name} ready again")
        assert ("restarted container", f"{ns}/{name} (exit -9, restart 1)") in cp.kubelet.events

        def tpu_workers_alive() -> int:
            status, body = dashboard_get(cp, ns, "slice", path)
            return sum(1 for n in json.loads(body)["data"]["result"]["result"]
                       if not n["is_head_node"] and n["resources_total"].get("TPU")) if status == 200 else 0

        wait_for(lambda: tpu_workers_alive() == 2, 120, "Ray listing the restarted host again")
    finally:
        force_delete_clusters(cp, ns)


def test_hosts_whose_raylet_registers_no_tpu_are_not_ready_and_are_named(
        airflow_home: Path, cp: ControlPlane, pools: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    ns = webhook_namespace(cp, monkeypatch)
    try:
        # A ray start flag that overrides what KubeRay derives from the google.com/tpu limit.
        source = lifecycle_dag("k8s_no_chips", create={
            "cluster_name": "no-chips", "accelerator": "v4", "topology": "2x2x2",
            "head_pod_template": on(pools["heads"]), "worker_ray_start_params": {"resources": "'{\"TPU\": 0}'"},
        }, sensor={"grace_period": 45}, retries=0)  # 20 s: under CI's load no raylet had registered yet
        outcome = run_dag(airflow_home, source, "k8s_no_chips")
        assert states(outcome) == {"create_cluster": "success", "wait_ready": "failed", "delete_cluster": "success"}
        log = capfd.readouterr().out
        assert "Ray has not listed its TPU hosts for " in log and "longer than the grace period of 45 s" in log
        assert "head ready; 2 of 2 TPU hosts ready (slice 0: 2/2); Ray lists 0 of 2 TPU hosts" in log
        failure = next(line for line in log.splitlines() if "longer than the grace period of 45 s" in line)
        # Each host is named: with TPU=0 once its raylet registered, else as not listed (yet).
        assert "has TPU=0, its pod 4" in failure, failure
        hosts = re.findall(r"pod (no-chips-tpu-slices-worker-\w+)", failure)
        assert len(set(hosts)) == 2 and failure.count("has TPU=0, its pod 4") + failure.count(
            "Ray does not list") >= 2, failure
    finally:
        force_delete_clusters(cp, ns)
