"""Our triggers never hold the triggerer's event loop: each runs, from a cold start in a fresh process, under
asyncio's debug mode, and no callback may take longer than 50 ms (imports, kubeconfig files, SSL contexts
and clients are made in worker threads).

The API server, the KubeRay reactor and the Jobs API run in the test's process, so their work does
not land on the probed loop. A loaded machine can stall any process for 50 ms, so a probe that
reports slow callbacks is run again (five runs at most: beside the control-plane tier's start three
runs once all saw 60-200 ms stalls); a callback that blocks for real does so in every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.jobs_stub import JobsStub
from tests.support.kube_connection import NAMESPACE
from tests.support.ray_state_stub import RayStateStub

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
RUNS = 5


Prepare = Callable[[int], tuple[dict[str, Any], Callable[[], None]]]


def probe(class_path: str, prepare: Prepare) -> dict[str, Any]:
    """Run the probe until a run reports no slow callback (at most :data:`RUNS` runs); the last report.

    ``prepare(run)`` makes what the run waits for and returns the trigger's kwargs and what to do
    (in a thread) while the probe runs.
    """
    reports = []
    for run in range(RUNS):
        kwargs, meanwhile = prepare(run)
        child = subprocess.Popen([sys.executable, "-m", "tests.fakeapi.loop_probe", class_path, json.dumps(kwargs)],
                                 cwd=REPO, stdout=subprocess.PIPE, text=True)
        helper = threading.Thread(target=meanwhile, daemon=True)
        helper.start()
        out, _ = child.communicate(timeout=120)
        helper.join(30)
        assert child.returncode == 0, out
        reports.append(json.loads(out.strip().splitlines()[-1]))
        if not reports[-1]["slow"]:
            return reports[-1]
    raise AssertionError(f"slow callbacks in every run: {[r['slow'] for r in reports]}")


def test_the_cluster_trigger_never_blocks_the_loop(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                   kuberay: KubeRayReactor) -> None:
    def prepare(run: int) -> tuple[dict[str, Any], Callable[[], None]]:
        name = f"train-{run}"
        kuberay.set_mode("hold", cluster=name, namespace=NAMESPACE)
        backend.apply_cluster(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4")))

        def turn_ready() -> None:
            kube.wait_for(lambda: kube.open_watches == 1, 60)
            kuberay.set_mode("auto", cluster=name, namespace=NAMESPACE)

        return {"cluster_name": name, "namespace": NAMESPACE, "raytpu_conn_id": "raytpu_default",
                "deadline": time.time() + 600, "poll_interval": 1.0}, turn_ready

    report = probe("airflow_provider_raytpu.triggers.raycluster.RayClusterReadyTrigger", prepare)
    assert report["event"]["status"] == "READY"


def test_the_cluster_trigger_confirming_with_ray_never_blocks_the_loop(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    """The same wait, READY confirmed with the pods' webhook variables and Ray's node list (through the proxy)."""
    tpu = TpuSlice("v6e", "4x4", num_slices=2)
    kuberay.tpu_webhook = True
    with RayStateStub(kube, NAMESPACE, tpu.pod_type) as ray:
        def prepare(run: int) -> tuple[dict[str, Any], Callable[[], None]]:
            name = f"confirm-{run}"
            kuberay.set_mode("hold", cluster=name, namespace=NAMESPACE)
            backend.apply_cluster(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=tpu))
            kube.register_service_proxy(NAMESPACE, f"{name}-head-svc", "dashboard", ray.url_for(name))

            def turn_ready() -> None:
                kube.wait_for(lambda: kube.open_watches == 1, 60)
                kuberay.set_mode("auto", cluster=name, namespace=NAMESPACE)

            return {"cluster_name": name, "namespace": NAMESPACE, "raytpu_conn_id": "raytpu_default",
                    "deadline": time.time() + 600, "poll_interval": 1.0, "confirm_with_ray": True}, turn_ready

        report = probe("airflow_provider_raytpu.triggers.raycluster.RayClusterReadyTrigger", prepare)
    assert report["event"]["status"] == "READY"
    assert report["event"]["cluster"]["ray_hosts"] == 8 and sum(ray.requests.values()) >= 1


def test_the_service_trigger_never_blocks_the_loop(connections: None, kube: FakeKubeApiServer) -> None:
    def prepare(run: int) -> tuple[dict[str, Any], Callable[[], None]]:
        return {"service_name": "chat", "namespace": NAMESPACE, "raytpu_conn_id": "raytpu_default",
                "deadline": time.time() + 600}, lambda: None

    report = probe("airflow_provider_raytpu.triggers.rayservice.RayServiceRunningTrigger", prepare)
    assert report["event"]["status"] == "GONE"


def test_the_job_trigger_never_blocks_the_loop(connections: None, kube: FakeKubeApiServer) -> None:
    with JobsStub() as jobs:
        kube.create_object({"apiVersion": "v1", "kind": "Service",
                            "metadata": {"name": "train-head-svc", "namespace": NAMESPACE},
                            "spec": {"ports": [{"name": "dashboard", "port": 8265}]}})
        kube.register_service_proxy(NAMESPACE, "train-head-svc", "dashboard", jobs.url_for("train"))

        def prepare(run: int) -> tuple[dict[str, Any], Callable[[], None]]:
            job = f"job-{run}"
            jobs.add("train", job, log="".join(f"step {i}\n" for i in range(200)))

            def finish() -> None:
                kube.wait_for(lambda: jobs.open_tails == 1, 60)
                jobs.finish("train", job, text='RAYTPU_RESULT {"ok": true}\n')

            return {"submission_id": job, "cluster_name": "train", "namespace": NAMESPACE,
                    "raytpu_conn_id": "raytpu_default", "poll_interval": 0.5}, finish

        report = probe("airflow_provider_raytpu.triggers.ray_job.RayJobTrigger", prepare)
    assert report["event"]["status"] == "SUCCEEDED" and report["event"]["result"] == {"ok": True}
