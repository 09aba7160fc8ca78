"""A fault soak: one run of ``raytpu_soak`` per scenario, each with one fault injected at a random point
while its Ray jobs run, and the invariants checked after every run (:func:`tests.deployment.soak.violations`):
no other run's object touched, no cluster left after the teardown, no duplicate Ray job, each job log line
once, no secret in any log or XCom.

The seed of the random points is printed with the results (``RAYTPU_SOAK_SEED`` repeats a soak).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from airflow_provider_raytpu.backends.local.process import all_processes
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.deployment.deployment import AirflowDeployment, local_backend, wait_cluster_ready
from tests.deployment.rest import AirflowApi
from tests.deployment.soak import DAG_ID, NAMESPACE, Soak, violations
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer

SEED = int(os.environ.get("RAYTPU_SOAK_SEED") or time.time())
RAY_CLUSTER = "soak-ray"
LITERAL = "soak-literal"


@pytest.fixture(scope="module")
def soak(deployment: AirflowDeployment, api: AirflowApi) -> Iterator[Soak]:
    """One real local Ray cluster behind the fake Kubernetes API's service proxy, and the two connections."""
    backend = local_backend(deployment)
    backend.apply_cluster(build_ray_cluster(name=RAY_CLUSTER, namespace="default", tpu=TpuSlice("v4", "2x2x1")))
    try:
        wait_cluster_ready(api, backend, RAY_CLUSTER, "the soak's Ray cluster ready")
        with FakeKubeApiServer() as kube, KubeRayReactor(kube, delay=0.1, stagger=0.01, tpu_webhook=True):
            dashboard = backend.dashboard(RAY_CLUSTER, "default").url
            kube.register_service_proxy(NAMESPACE, "*", "dashboard", dashboard)
            bystander = kube.create_object(build_ray_cluster(
                name="bystander", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                origin=AirflowOrigin("another_dag", "scheduled__2026-12-01T00:00:00+00:00", "create_cluster")))
            api.save_connection({"connection_id": "kube_soak", "conn_type": "kubernetes", "extra": json.dumps(
                {"kube_config": json.dumps(kube.kubeconfig_dict(NAMESPACE)), "namespace": NAMESPACE})})
            api.save_connection({"connection_id": "raytpu_soak", "conn_type": "raytpu", "extra": json.dumps(
                {"backend": "kubernetes", "kubernetes_conn_id": "kube_soak", "namespace": NAMESPACE,
                 # The fake API's pods are not the hosts of the Ray cluster its proxy reaches.
                 "confirm_with_ray": False})})
            api.unpause(DAG_ID)
            yield Soak(deployment, api, kube, dashboard, bystander)
    finally:
        backend.delete_cluster(RAY_CLUSTER, "default")


def run_with_fault(soak: Soak, name: str, target: str, inject: Callable[[str], str],
                   conf: dict[str, str] | None = None) -> str:
    """Trigger a run; once ``target``'s Ray job runs, wait a random moment and ``inject`` a fault (it returns
    what it did); wait for the run to end; check the invariants. Returns the run id."""
    api, rng = soak.api, random.Random(f"{SEED}-{name}")
    run_id = api.trigger(DAG_ID, conf)
    api.wait(f"{target}'s Ray job running", lambda: soak.running(run_id, target), 240)
    delay = rng.uniform(0.5, 8.0)
    time.sleep(delay)
    did = inject(run_id)
    state = api.wait_run(DAG_ID, run_id, timeout=480)
    broken = violations(soak, run_id)
    soak.record.append({"scenario": name, "fault": did, "at_seconds_into_the_job": round(delay, 1),
                        "run_state": state, "invariants_broken": broken, "seed": SEED})
    assert not broken, f"{name} (seed {SEED}): {broken}\n{api.run_report(DAG_ID, run_id)}"
    # failing_job fails on purpose (a secret in its --config, three lines): the run fails, the rest succeed.
    assert {t: api.task(DAG_ID, run_id, t)["state"] for t in ("job", "sync_job", "delete_cluster")} == {
        "job": "success", "sync_job": "success", "delete_cluster": "success"}, api.run_report(DAG_ID, run_id)
    return run_id


def command_line(process: psutil.Process) -> str:
    """The process's command line; empty for one that exited (or is a zombie) since it was listed."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def kill_task_process(soak: Soak, run_id: str, task_id: str) -> str:
    """SIGKILL the process running the task (``airflow worker -- <ti id>``): a worker lost mid-task."""
    ti_id = soak.api.task(DAG_ID, run_id, task_id)["id"]
    victims = [p for p in all_processes() if f"airflow worker -- {ti_id}" in command_line(p)]
    assert victims, f"no process runs {task_id} ({ti_id})"
    for process in victims:
        process.kill()
    psutil.wait_procs(victims, 10)
    return f"SIGKILL of {task_id}'s worker process {[p.pid for p in victims]}"


def test_a_worker_killed_mid_job(soak: Soak) -> None:
    run_with_fault(soak, "worker SIGKILL", "sync_job", lambda run_id: kill_task_process(soak, run_id, "sync_job"))


def test_the_triggerer_killed_mid_job(soak: Soak) -> None:
    def crash(run_id: str) -> str:
        soak.deployment.restart_triggerer(crash=True)
        return "SIGKILL of the triggerer, a new one started"

    run_with_fault(soak, "triggerer SIGKILL", "job", crash)


def test_the_kubernetes_api_server_restarted_mid_job(soak: Soak) -> None:
    def restart(run_id: str) -> str:
        soak.kube.drop_connections()
        soak.kube.inject(None, r".*", 503, times=None, message="the API server is starting")
        time.sleep(8)
        soak.kube.clear_faults()
        return "every connection to the Kubernetes API dropped, then 8 s of 503"

    run_with_fault(soak, "Kubernetes API server restart", "job", restart)


def test_the_airflow_api_server_restarted_mid_job(soak: Soak) -> None:
    def restart(run_id: str) -> str:
        soak.deployment.stop("api-server")
        soak.deployment.start("api-server")
        soak.deployment.wait_healthy(("api-server",))
        return "Airflow's api-server (the execution API) stopped and started again"

    run_with_fault(soak, "Airflow API server restart", "job", restart)


def test_the_dashboard_unreachable_for_60_s_mid_job(soak: Soak) -> None:
    def outage(run_id: str) -> str:
        soak.kube.inject(None, r"/services/[^/]+:dashboard/proxy/", 503, times=None,
                         message="no endpoints available for service")
        time.sleep(60)
        soak.kube.clear_faults()
        return "the dashboard answered 503 through the proxy for 60 s"

    run_with_fault(soak, "dashboard 503 for 60 s", "job", outage)


def test_a_second_run_with_the_same_literal_cluster_name(soak: Soak) -> None:
    """Run 2's create conflicts and its teardown, by that name, must leave run 1's cluster alone."""
    api = soak.api
    second: dict[str, str] = {}

    def overlap(run_id: str) -> str:
        second["run_id"] = api.trigger(DAG_ID, {"cluster_name": LITERAL})
        api.wait_run(DAG_ID, second["run_id"], timeout=240)
        return f"run {second['run_id']} with cluster_name={LITERAL!r} while this run's jobs ran"

    first = run_with_fault(soak, "a second run with the literal cluster name", "job", overlap,
                           {"cluster_name": LITERAL})
    assert api.task(DAG_ID, second["run_id"], "create_cluster")["state"] == "failed"
    deleted = api.xcom(DAG_ID, second["run_id"], "delete_cluster")
    assert (deleted["deleted"], deleted["skipped"]) == (False, [LITERAL])
    assert api.xcom(DAG_ID, first, "delete_cluster")["deleted"] is True
    assert violations(soak, second["run_id"], jobs_ran=False) == []


def test_the_soak_injected_every_fault_and_every_invariant_held(soak: Soak, record_property: Callable) -> None:
    record_property("fault_soak", soak.record)
    assert [r["scenario"] for r in soak.record] == [
        "worker SIGKILL", "triggerer SIGKILL", "Kubernetes API server restart", "Airflow API server restart",
        "dashboard 503 for 60 s", "a second run with the literal cluster name"]
    assert all(not r["invariants_broken"] for r in soak.record)
