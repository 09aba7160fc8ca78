"""Backend gke: the Google provider's hooks find the cluster through the GKE API and refresh tokens."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.gke_stub import GoogleStub

PROJECT = "tpu-project"


@pytest.fixture
def gke(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    lifetime = getattr(request, "param", 10)
    with FakeKubeApiServer(tls=True) as kube, KubeRayReactor(kube, delay=0.1, stagger=0.01):
        with GoogleStub(f"127.0.0.1:{kube.port}", kube.ca_pem, lifetime, kube.accept_token) as google:
            monkeypatch.setenv("AIRFLOW_CONN_GCP_TEST", google.gcp_connection(PROJECT))
            monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps({"conn_type": "raytpu", "extra": {
                "backend": "gke", "gcp_conn_id": "gcp_test", "project_id": PROJECT, "location": "us-east5",
                "cluster": "tpu-cluster", "namespace": "ml", "gke_api_endpoint": google.url,
                "confirm_with_ray": False}}))
            yield kube, google


def manifest() -> dict:
    return build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v5p", "2x2x2"))


def test_lifecycle_through_gke_hooks(gke: tuple[FakeKubeApiServer, GoogleStub]) -> None:
    kube, google = gke
    backend = RayTpuHook().backend
    assert isinstance(backend, KubeRayBackend)
    backend.apply_cluster(manifest())
    assert google.cluster_reads == ["/v1/projects/tpu-project/locations/us-east5/clusters/tpu-cluster"]
    assert backend.dashboard("train", "ml").url.startswith(f"https://127.0.0.1:{kube.port}/api/v1/namespaces/ml/")
    kube.wait_for(lambda: (kube.get_object("rayclusters", "ml", "train").get("status") or {}).get("state") == "ready")
    assert backend.cluster_status("train", "ml").phase is Phase.READY
    assert backend.delete_cluster("train", "ml")


def test_short_lived_tokens_are_refreshed_not_cached(gke: tuple[FakeKubeApiServer, GoogleStub]) -> None:
    _, google = gke
    backend = RayTpuHook().backend
    for _ in range(3):
        backend.get_cluster("train", "ml")
    # A token that expires within google-auth's refresh margin is never reused.
    assert len(set(google.tokens)) >= 3


@pytest.mark.parametrize("gke", [3600], indirect=True)
def test_valid_tokens_are_reused(gke: tuple[FakeKubeApiServer, GoogleStub]) -> None:
    _, google = gke
    backend = RayTpuHook().backend
    for _ in range(3):
        backend.get_cluster("train", "ml")
    assert len(google.tokens) == 1


def test_trigger_watches_through_the_async_gke_hook(gke: tuple[FakeKubeApiServer, GoogleStub]) -> None:
    kube, _ = gke
    RayTpuHook().backend.apply_cluster(manifest())

    async def first_event() -> dict:
        async for event in RayClusterReadyTrigger("train", "ml", "raytpu_default", time.time() + 30, 0.5).run():
            return event.payload
        raise AssertionError("no event")

    assert asyncio.run(first_event())["status"] == "READY"
    assert kube.count("GET", r"/rayclusters$", watch=True) + kube.count("GET", r"/rayclusters$", watch=False) >= 1


def test_the_shared_async_client_refreshes_gke_tokens_in_place(gke: tuple[FakeKubeApiServer, GoogleStub],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_raytpu.backends.kuberay import shared_client
    from airflow_provider_raytpu.backends.kuberay.clients import shared_api_client

    monkeypatch.setattr(shared_client, "CREDENTIALS_MAX_AGE_SECONDS", 0.0)  # every request reloads the token
    kube, google = gke
    backend = RayTpuHook().backend
    backend.apply_cluster(manifest())

    async def run() -> tuple[str, int]:
        async for event in RayClusterReadyTrigger("train", "ml", "raytpu_default", time.time() + 30, 0.5).run():
            shared = await shared_api_client(backend.settings)
            return event.payload["status"], shared.clients_made
        raise AssertionError("no event")

    issued = len(google.tokens)
    assert asyncio.run(run()) == ("READY", 1)
    assert len(set(google.tokens)) - issued >= 2, "tokens were fetched again for the same client"


@pytest.mark.parametrize("backend_kind", ["gke", "kubernetes"])
def test_every_sync_request_ends_and_a_retry_after_is_capped(gke: tuple[FakeKubeApiServer, GoogleStub],
                                                            backend_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request on a connection that never answers ends after the request timeout (the GKE hook's client sets
    none), and urllib3, which obeys a 429's Retry-After under the sync client, waits at most RETRY_AFTER_CAP."""
    from urllib3.exceptions import MaxRetryError, ReadTimeoutError

    from airflow_provider_raytpu.backends.kuberay.clients import RETRY_AFTER_CAP, KubeClients

    kube, _ = gke
    if backend_kind == "kubernetes":
        monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection("ml"))
        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps({"conn_type": "raytpu", "extra": {
            "backend": "kubernetes", "kubernetes_conn_id": "kube_test", "namespace": "ml"}}))
    clients = KubeClients(RayTpuHook().settings, request_timeout=1)
    pool_retries = clients.api_client.rest_client.pool_manager.connection_pool_kw["retries"]
    assert (pool_retries.total, pool_retries.retry_after_max) == (3, RETRY_AFTER_CAP)
    kube.create_object(manifest())
    kube.stall("GET", r"/rayclusters/train$", 5, times=None)  # answered, but only after 5 s
    with pytest.raises((ReadTimeoutError, MaxRetryError)):  # each of urllib3's 4 tries ended after 1 s
        clients.custom_objects.get_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "train")
    assert kube.count("GET", r"/rayclusters/train$") == 4
