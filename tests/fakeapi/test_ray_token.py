"""Ray's token authentication on KubeRay clusters, against the fake API server over HTTP: ``authOptions`` at
create (and not where this KubeRay lacks it), and the token of each cluster's Secret on every dashboard
request, sync and async, the log-tail WebSocket included. The head is the Jobs stub answering as Ray's
token middleware does; the real KubeRay and Ray heads are in tests/controlplane/test_ray_confirm.py."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.dashboard.jobs import JobsApi, RayAuthenticationError
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks import raytpu as raytpu_hook
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger
from tests.support.fake_apiserver.server import KUBERAY_SCHEMAS, FakeKubeApiServer
from tests.support.jobs_stub import JobsStub
from tests.support.kube_connection import NAMESPACE, raytpu_connection

pytestmark = pytest.mark.timeout(120)

TOKEN = "the-first-token"


def token_cluster(kube: FakeKubeApiServer, name: str, token: str | None) -> None:
    """A RayCluster as KubeRay keeps one with ``authOptions.mode: token`` (``token=None``: without), its
    Secret ``auth_token`` and its head service."""
    manifest = build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"))
    if token is not None:
        manifest["spec"]["authOptions"] = {"mode": "token"}
        kube.create_object({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE},
                            "data": {"auth_token": base64.b64encode(token.encode()).decode()}})
    kube.create_object(manifest)
    kube.create_object({"apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": f"{name}-head-svc", "namespace": NAMESPACE},
                        "spec": {"ports": [{"name": "dashboard", "port": 8265}]}})


@pytest.fixture
def jobs(kube: FakeKubeApiServer, connections: None) -> Iterator[JobsStub]:
    """Cluster ``a`` with token authentication, ``b`` without; each one job."""
    with JobsStub() as stub:
        for cluster, token in (("a", TOKEN), ("b", None)):
            token_cluster(kube, cluster, token)
            kube.register_service_proxy(NAMESPACE, f"{cluster}-head-svc", "dashboard", stub.url_for(cluster))
            stub.add(cluster, "job-1", log="line 0\nline 1\n")
        stub.tokens["a"] = TOKEN
        yield stub


def test_the_sync_job_client_sends_each_clusters_token(jobs: JobsStub, backend: KubeRayBackend,
                                                       kube: FakeKubeApiServer) -> None:
    assert JobsApi(backend.dashboard("a", NAMESPACE)).get_job_info("job-1").status == "RUNNING"
    assert jobs.requests[("a", "get")] == 1
    before = kube.count("GET", r"/rayclusters/b$")
    transport = backend.dashboard("b", NAMESPACE)
    for _ in range(3):
        assert transport.request("GET", "/api/jobs/job-1").ok
    assert kube.count("GET", r"/rayclusters/b$") == before + 1, "a cluster without a token is read once"


async def first_event(trigger: RayJobTrigger) -> dict:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("no event")


async def test_the_trigger_follows_a_job_and_tails_its_log_with_the_token(jobs: JobsStub,
                                                                          kube: FakeKubeApiServer) -> None:
    trigger = RayJobTrigger("job-1", "a", NAMESPACE, "raytpu_default", poll_interval=0.1)
    task = asyncio.create_task(first_event(trigger))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.open_tails == 1, 10)
    jobs.finish("a", "job-1", text='RAYTPU_RESULT {"rows": 2}\n')
    event = await asyncio.wait_for(task, 60)
    assert (event["status"], event["result"]) == ("SUCCEEDED", {"rows": 2})
    assert jobs.requests[("a", "tail")] == 1, "the log-tail WebSocket carried the token too"


async def test_a_followed_job_costs_one_api_request_per_tick_and_its_token_is_read_once(
        jobs: JobsStub, kube: FakeKubeApiServer) -> None:
    kube.clear_log()
    task = asyncio.create_task(first_event(RayJobTrigger("job-1", "a", NAMESPACE, "raytpu_default",
                                                         poll_interval=0.05)))
    await asyncio.to_thread(kube.wait_for, lambda: jobs.requests[("a", "list")] >= 20, 30)
    jobs.finish("a", "job-1")
    assert (await asyncio.wait_for(task, 60))["status"] == "SUCCEEDED"
    assert (kube.count("GET", r"/rayclusters/a$"), kube.count("GET", r"/secrets/a$")) == (1, 1)
    through_proxy = kube.count(path_regex=r"/services/a-head-svc:dashboard/proxy/")
    assert through_proxy == jobs.requests[("a", "list")] + jobs.requests[("a", "tail")]
    assert kube.count() == through_proxy + 2, [r for r in kube.requests if "/proxy/" not in r.path]


async def test_a_backend_the_triggerer_replaces_is_closed(jobs: JobsStub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raytpu_hook, "SETTINGS_MAX_AGE_SECONDS", 0.0)
    hook = RayTpuHook()
    first = await hook.abackend()
    assert await asyncio.to_thread(first.list_clusters, NAMESPACE, "")
    pools = first.clients.api_client.rest_client.pool_manager.pools
    assert len(pools) == 1
    second = await hook.abackend()
    assert second is not first and len(pools) == 0, "the replaced backend's connections are closed"


def test_a_new_token_is_read_again_once_ray_refuses_the_old_one(jobs: JobsStub, backend: KubeRayBackend,
                                                                kube: FakeKubeApiServer) -> None:
    transport = backend.dashboard("a", NAMESPACE)
    assert transport.request("GET", "/api/jobs/job-1").ok
    # The cluster was made again under its name: KubeRay made a new Secret, with a new token.
    kube.patch_object("secrets", NAMESPACE, "a", {"data": {"auth_token": base64.b64encode(b"the-second").decode()}})
    jobs.tokens["a"] = "the-second"
    assert transport.request("GET", "/api/jobs/job-1").ok
    assert jobs.requests[("a", "get")] == 2


def test_without_ray_auth_rays_refusal_is_explained(jobs: JobsStub, kube: FakeKubeApiServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(ray_auth=False))
    with pytest.raises(RayAuthenticationError, match=(
            "Authentication required: Unauthorized: Missing authentication token\n\nToken authentication is enabled "
            "but no authentication token was found \\(on Kubernetes, the raytpu connection's ray_auth")):
        JobsApi(RayTpuHook().backend.dashboard("a", NAMESPACE)).get_job_info("job-1")


def test_a_refused_secret_read_names_the_rule_and_an_outage_is_a_503(jobs: JobsStub, backend: KubeRayBackend,
                                                                     kube: FakeKubeApiServer) -> None:
    kube.inject("GET", r"/secrets/a$", 403, times=1)
    with pytest.raises(FatalError, match=(
            r"Reading Secret ml/a \(the Ray token of RayCluster ml/a\) was refused: grant 'get' on secrets in "
            r"namespace 'ml' \(docs/rbac.yaml\), or set the connection's ray_auth to false")):
        backend.dashboard("a", NAMESPACE).request("GET", "/api/jobs/job-1")
    kube.inject("GET", r"/secrets/a$", 500, times=None)
    answer = backend.dashboard("a", NAMESPACE).request("GET", "/api/jobs/job-1")
    assert answer.status == 503 and "reading the Ray token of RayCluster ml/a" in answer.text()
    kube.clear_faults()
    assert backend.dashboard("a", NAMESPACE).request("GET", "/api/jobs/job-1").ok


@pytest.mark.parametrize(("schemas", "auth_options"), [(KUBERAY_SCHEMAS, {"mode": "token"}),
                                                       (KUBERAY_SCHEMAS.replace("v1.7.0", "v1.5.0"), None)])
def test_create_turns_token_auth_on_where_kuberay_knows_it(schemas: str, auth_options: dict | None,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The documented Role cannot read the cluster-wide CRD: authOptions is tried, and a KubeRay 1.5.0 (whose
    schema has no authOptions, so Strict validation refuses it) gets the cluster without it, and a warning."""
    with FakeKubeApiServer(crd_dir=schemas) as kube:
        monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection(NAMESPACE))
        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection())
        kube.inject("GET", r"customresourcedefinitions", 403, times=None)
        backend = RayTpuHook().backend
        backend.apply_cluster(build_ray_cluster(name="c", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2")))
        assert kube.get_object("rayclusters", NAMESPACE, "c")["spec"].get("authOptions") == auth_options
        warned = [r.getMessage() for r in caplog.records if "does not know spec.authOptions" in r.getMessage()]
        assert len(warned) == (auth_options is None), warned
