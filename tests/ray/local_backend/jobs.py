"""What the Ray job tests share: the job DAG they write, the jobs a DAG submitted, a worker process to kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from ray.job_submission import JobSubmissionClient

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.local import LocalBackend
    from tests.ray.local_backend.emulated import EmulatedCluster
    from tests.support.fake_apiserver.server import FakeKubeApiServer

REPO = Path(__file__).resolve().parents[3]
#: Every Jobs API path of the emulated cluster ``emu`` through the API server's service proxy.
PROXIED = r"/api/v1/namespaces/ml/services/emu-head-svc:dashboard/proxy/api/"


def task_jobs(jobs: JobSubmissionClient, dag_id: str) -> list:
    found = [j for j in jobs.list_jobs() if (j.metadata or {}).get("raytpu.dag_id") == dag_id]
    return sorted(found, key=lambda j: int(j.metadata["raytpu.try_number"]))


def submit_dag(dag_id: str, code: str, *, retries: int = 0, deferrable: bool = True, args: tuple[str, ...] = ()) -> str:
    return f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    SubmitRayJobOperator(
        task_id="job", cluster_name="emu", retries={retries}, retry_delay=0, deferrable={deferrable},
        poll_interval=0.5, entrypoint=["python", "-c", {code!r}, *{list(args)!r}],
        runtime_env={{"env_vars": {{"GREETING": "hello from airflow"}}}},
    )
'''


def start_worker(dag_path: Path, dag_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.airflow_runner", str(dag_path), dag_id], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_for_job(jobs: JobSubmissionClient, dag_id: str, count: int, status: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = task_jobs(jobs, dag_id)
        if len(found) >= count and str(found[count - 1].status) == status:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {status} job #{count} for {dag_id}: {task_jobs(jobs, dag_id)}")


def kill_worker(worker: subprocess.Popen) -> None:
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(30)



def proxied_dag(dag_id: str, code: str, **kwargs: object) -> str:
    """:func:`submit_dag` on the connection ``raytpu_k8s`` (backend kubernetes, the dashboard through the proxy)."""
    return submit_dag(dag_id, code, **kwargs).replace('cluster_name="emu",',
                                                      'cluster_name="emu", raytpu_conn_id="raytpu_k8s",')


@contextlib.contextmanager
def behind_the_api_server_proxy(local_backend: LocalBackend, cluster: EmulatedCluster,
                                monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKubeApiServer]:
    """The emulated cluster as a RayCluster ``ml/emu`` of a Kubernetes API (TLS), its dashboard behind the
    API server's service proxy; the connection ``raytpu_k8s`` reaches it that way."""
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice
    from tests.support.fake_apiserver.kuberay import KubeRayReactor
    from tests.support.fake_apiserver.server import FakeKubeApiServer

    with FakeKubeApiServer(tls=True) as kube, KubeRayReactor(kube, delay=0.1, stagger=0.01):
        # The RayCluster as KubeRay reports it (the job task checks it is ready), its head Service proxied here.
        kube.create_object(build_ray_cluster(name="emu", namespace="ml", tpu=TpuSlice("v4", "2x2x2")))
        kube.wait_for(lambda: kube.get_object("services", "ml", "emu-head-svc"), 10)
        kube.register_service_proxy("ml", "emu-head-svc", "dashboard",
                                    local_backend.dashboard(cluster.name, cluster.namespace).url)
        monkeypatch.setenv("AIRFLOW_CONN_KUBE_PROXY", kube.airflow_connection("ml"))
        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_K8S", json.dumps(
            {"conn_type": "raytpu", "extra": {"backend": "kubernetes", "kubernetes_conn_id": "kube_proxy",
                                              # the fake API's pods are not the emulated cluster's hosts
                                              "namespace": "ml", "confirm_with_ray": False}}))
        yield kube
