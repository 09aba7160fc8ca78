"""The fake API server and the fake KubeRay operator, exercised with the official clients over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import urllib3
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes import watch as kwatch
from kubernetes.client.rest import ApiException
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from .fixtures import akube_api, fake_kube, fake_kuberay, kube_api  # noqa: F401 (fixtures)
from .kuberay import FINALIZER, KubeRayReactor, auto, hold, replica_failure, unschedulable
from .server import KUBERAY_SCHEMAS, FakeKubeApiServer

pytestmark = pytest.mark.timeout(30)

G, V, NS = "ray.io", "v1", "default"


# ------------------------------------------------------------------------------------------------
# fixtures and manifests
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def server(fake_kube):
    return fake_kube


@pytest.fixture
def api(kube_api):
    return kube_api


@pytest.fixture
def custom(api):
    return kclient.CustomObjectsApi(api)


@pytest.fixture
def core(api):
    return kclient.CoreV1Api(api)


@pytest.fixture
def aapi(akube_api):
    return akube_api


@pytest.fixture
def reactor(fake_kuberay):
    return fake_kuberay


def raycluster(name: str, *, replicas: int = 2, hosts: int = 4, labels: dict | None = None) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": labels or {"app": "demo"}},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{
                    "name": "ray-head", "image": "rayproject/ray:2.60.0",
                    "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}},
                }]}},
            },
            "workerGroupSpecs": [{
                "groupName": "tpu-v6e-4x4", "replicas": replicas, "minReplicas": 0, "maxReplicas": replicas,
                "numOfHosts": hosts, "rayStartParams": {},
                "template": {
                    "metadata": {"labels": {"team": "ml"}},
                    "spec": {
                        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                         "cloud.google.com/gke-tpu-topology": "4x4"},
                        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [{
                            "name": "ray-worker", "image": "rayproject/ray:2.60.0",
                            "resources": {"requests": {"google.com/tpu": "4", "cpu": "8"}, "limits": {"google.com/tpu": "4"}},
                        }],
                    },
                },
            }],
        },
    }


def body_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def pod(name: str, labels: dict, *, node: str | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "busybox:1.36"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


# ------------------------------------------------------------------------------------------------
# server basics
# ------------------------------------------------------------------------------------------------

def test_discovery_version_and_auth(server, api):
    assert kclient.VersionApi(api).get_code().git_version == "v1.37.2"
    groups = kclient.ApisApi(api).get_api_versions()
    assert [g.name for g in groups.groups] == ["ray.io"]
    resources = kclient.CustomObjectsApi(api).get_api_resources(G, V)
    assert {"rayclusters", "rayclusters/status", "rayservices", "rayjobs"} <= {r.name for r in resources.resources}

    with pytest.raises(urllib.error.HTTPError) as err:  # no token
        urllib.request.urlopen(f"{server.url}/api/v1/namespaces/default/pods")
    assert err.value.code == 401
    assert json.loads(err.value.read())["reason"] == "Unauthorized"
    assert urllib.request.urlopen(f"{server.url}/readyz").read() == b"ok"

    bad = server.kubeconfig_dict()
    bad["users"][0]["user"]["token"] = "wrong"
    bad_client = kconfig.new_client_from_config_dict(bad)
    with pytest.raises(ApiException) as exc:
        kclient.CoreV1Api(bad_client).list_namespaced_pod(NS)
    assert exc.value.status == 401
    bad_client.close()


def test_custom_object_crud_and_error_bodies(server, custom):
    created = custom.create_namespaced_custom_object(G, V, NS, "rayclusters", dict(raycluster("c1"), status={"state": "ready"}))
    meta = created["metadata"]
    assert meta["uid"] and meta["resourceVersion"].isdigit() and meta["generation"] == 1 and meta["creationTimestamp"]
    assert "status" not in created  # status subresource: dropped on create

    with pytest.raises(ApiException) as exc:
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("c1"))
    assert exc.value.status == 409
    assert body_of(exc.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'rayclusters.ray.io "c1" already exists', "reason": "AlreadyExists",
        "details": {"name": "c1", "group": "ray.io", "kind": "rayclusters"}, "code": 409}

    with pytest.raises(ApiException) as exc:
        custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "nope")
    assert exc.value.status == 404
    assert body_of(exc.value)["message"] == 'rayclusters.ray.io "nope" not found'
    assert body_of(exc.value)["reason"] == "NotFound"

    # generateName and dryRun
    gen = raycluster("x")
    gen["metadata"] = {"generateName": "gen-", "labels": {"app": "demo"}}
    made = custom.create_namespaced_custom_object(G, V, NS, "rayclusters", gen)
    assert made["metadata"]["name"].startswith("gen-") and len(made["metadata"]["name"]) == 9
    dry = custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("dry"), dry_run="All")
    assert dry["metadata"]["name"] == "dry" and "resourceVersion" not in dry["metadata"]
    assert server.get_object("rayclusters", NS, "dry") is None

    # replace: stale resourceVersion -> Conflict; none -> Invalid (custom resources need one)
    current = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "c1")
    stale = json.loads(json.dumps(current))
    current["spec"]["workerGroupSpecs"][0]["replicas"] = 3
    replaced = custom.replace_namespaced_custom_object(G, V, NS, "rayclusters", "c1", current)
    assert replaced["metadata"]["generation"] == 2
    assert int(replaced["metadata"]["resourceVersion"]) > int(stale["metadata"]["resourceVersion"])
    with pytest.raises(ApiException) as exc:
        custom.replace_namespaced_custom_object(G, V, NS, "rayclusters", "c1", stale)
    assert exc.value.status == 409 and body_of(exc.value)["reason"] == "Conflict"
    assert body_of(exc.value)["message"] == (
        'Operation cannot be fulfilled on rayclusters.ray.io "c1": the object has been modified; '
        "please apply your changes to the latest version and try again")
    del stale["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as exc:
        custom.replace_namespaced_custom_object(G, V, NS, "rayclusters", "c1", stale)
    assert exc.value.status == 422 and "must be specified for an update" in body_of(exc.value)["message"]

    listed = custom.list_namespaced_custom_object(G, V, NS, "rayclusters", label_selector="app=demo")
    assert listed["kind"] == "RayClusterList" and [i["metadata"]["name"] for i in listed["items"]] == ["c1", made["metadata"]["name"]]
    assert len(custom.list_cluster_custom_object(G, V, "rayclusters")["items"]) == 2

    deleted = custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "c1")
    assert deleted["status"] == "Success" and deleted["details"]["name"] == "c1"
    with pytest.raises(ApiException) as exc:
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "c1")
    assert exc.value.status == 404

    server.deny("get", "rayclusters")
    with pytest.raises(ApiException) as exc:
        custom.get_namespaced_custom_object(G, V, NS, "rayclusters", made["metadata"]["name"])
    assert exc.value.status == 403
    assert body_of(exc.value)["message"] == (
        f'rayclusters.ray.io "{made["metadata"]["name"]}" is forbidden: User "{server.user}" cannot get resource '
        '"rayclusters" in API group "ray.io" in the namespace "default"')


def test_core_selectors(server, core):
    core.create_namespaced_pod(NS, pod("a", {"app": "x", "tier": "head"}, node="n1"))
    core.create_namespaced_pod(NS, pod("b", {"app": "x", "tier": "worker"}))
    core.create_namespaced_pod(NS, pod("c", {"app": "y"}))
    core.create_namespaced_pod("other", pod("d", {"app": "x"}))

    def names(**kw):
        return [p.metadata.name for p in core.list_namespaced_pod(NS, **kw).items]

    assert names(label_selector="app=x") == ["a", "b"]
    assert names(label_selector="app==x,tier!=head") == ["b"]
    assert names(label_selector="tier in (head, worker)") == ["a", "b"]
    assert names(label_selector="tier notin (head)") == ["b", "c"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!tier") == ["c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="spec.nodeName=n1") == ["a"]
    assert names(field_selector="status.phase=Pending,metadata.name!=a") == ["b", "c"]
    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(label_selector="app=x").items] == ["a", "b", "d"]
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, field_selector="spec.bogus=1")
    assert exc.value.status == 400 and body_of(exc.value)["message"] == "field label not supported: spec.bogus"

    p = core.read_namespaced_pod("a", NS)
    assert p.status.phase == "Pending" and p.metadata.generation == 1
    core.create_namespaced_event(NS, {"metadata": {"name": "a.1"}, "involvedObject": {"kind": "Pod", "name": "a"},
                                      "reason": "FailedScheduling", "message": "m", "type": "Warning"})
    evs = core.list_namespaced_event(NS, field_selector="involvedObject.name=a,involvedObject.kind=Pod")
    assert [e.reason for e in evs.items] == ["FailedScheduling"]
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("zz", NS)
    assert body_of(exc.value)["message"] == 'pods "zz" not found'
    assert body_of(exc.value)["details"] == {"name": "zz", "kind": "pods"}
    core.delete_collection_namespaced_pod(NS, label_selector="app=x")
    assert names() == ["c"]


def test_service_proxy(server, core):
    core.create_namespaced_service(NS, {"metadata": {"name": "rc-head-svc"},
                                        "spec": {"clusterIP": "None", "ports": [{"name": "dashboard", "port": 8265}]}})
    with pytest.raises(ApiException) as exc:
        core.connect_get_namespaced_service_proxy_with_path("rc-head-svc:dashboard", NS, "api/version")
    assert exc.value.status == 503
    assert body_of(exc.value)["message"] == 'no endpoints available for service "rc-head-svc:dashboard"'
    server.register_service_proxy(NS, "rc-head-svc", "dashboard", server.url)  # any HTTP server will do
    body = core.connect_get_namespaced_service_proxy_with_path("rc-head-svc:dashboard", NS, "version")
    assert "v1.37.2" in body
    assert server.count(verb="proxy") == 2


def test_status_subresource(server, custom):
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("s1"))
    obj = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "s1")
    obj["status"] = {"state": "ready"}
    after = custom.replace_namespaced_custom_object(G, V, NS, "rayclusters", "s1", obj)
    assert "status" not in after  # main resource ignores .status
    assert after["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]  # no-op write

    after["status"] = {"state": "ready", "readyWorkerReplicas": 8}
    after["spec"]["rayVersion"] = "9.9.9"  # ignored on /status
    st = custom.replace_namespaced_custom_object_status(G, V, NS, "rayclusters", "s1", after)
    assert st["status"]["readyWorkerReplicas"] == 8 and st["spec"]["rayVersion"] == "2.60.0"
    assert st["metadata"]["generation"] == 1
    patched = custom.patch_namespaced_custom_object_status(G, V, NS, "rayclusters", "s1",
                                                           {"status": {"readyWorkerReplicas": 4}})
    assert patched["status"] == {"state": "ready", "readyWorkerReplicas": 4}
    spec_patch = custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "s1",
                                                       {"spec": {"suspend": True}, "status": {"state": "x"}})
    assert spec_patch["metadata"]["generation"] == 2 and spec_patch["status"]["state"] == "ready"

    # core pods: /status only
    server.create_object(pod("p", {"a": "b"}))
    core = kclient.CoreV1Api(custom.api_client)
    core.patch_namespaced_pod("p", NS, {"status": {"phase": "Running"}})
    assert core.read_namespaced_pod("p", NS).status.phase == "Pending"
    core.patch_namespaced_pod_status("p", NS, {"status": {"phase": "Running"}})
    assert core.read_namespaced_pod_status("p", NS).status.phase == "Running"


async def test_patch_content_types_async(server, aapi):
    api = aclient.CustomObjectsApi(aapi)
    await api.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("p1"))
    # kubernetes_asyncio sends a dict body as application/json-patch+json: a real server says 400
    with pytest.raises(AsyncApiException) as exc:
        await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "p1", {"metadata": {"labels": {"x": "1"}}})
    assert exc.value.status == 400
    assert json.loads(exc.value.body)["message"] == "json: cannot unmarshal object into Go value of type jsonpatch.Patch"

    merged = await api.patch_namespaced_custom_object(
        G, V, NS, "rayclusters", "p1", {"metadata": {"labels": {"x": "1", "app": None}}},
        _content_type="application/merge-patch+json")
    assert merged["metadata"]["labels"] == {"x": "1"}

    ops = [{"op": "test", "path": "/metadata/labels/x", "value": "1"},
           {"op": "add", "path": "/metadata/annotations", "value": {"a/b": "c"}},
           {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 1},
           {"op": "remove", "path": "/metadata/labels/x"}]
    jp = await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "p1", ops)
    assert jp["metadata"]["annotations"] == {"a/b": "c"} and "labels" not in jp["metadata"] or jp["metadata"]["labels"] == {}
    assert jp["spec"]["workerGroupSpecs"][0]["replicas"] == 1 and jp["metadata"]["generation"] == 2

    with pytest.raises(AsyncApiException) as exc:
        await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "p1",
                                                 [{"op": "test", "path": "/spec/rayVersion", "value": "1.0"}])
    assert exc.value.status == 422
    with pytest.raises(AsyncApiException) as exc:  # custom resources have no strategic merge patch
        await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "p1", {"spec": {}},
                                                 _content_type="application/strategic-merge-patch+json")
    assert exc.value.status == 415
    req = urllib.request.Request(f"{server.url}/apis/ray.io/v1/namespaces/default/rayclusters/p1", data=b"spec: {}",
                                 method="PATCH", headers={"Authorization": f"Bearer {server.token}",
                                                          "Content-Type": "application/yaml"})
    with pytest.raises(urllib.error.HTTPError) as herr:
        await asyncio.to_thread(urllib.request.urlopen, req)
    assert herr.value.code == 415 and json.loads(herr.value.read())["reason"] == "UnsupportedMediaType"

    # kubernetes_asyncio does not retry: 429 and 503 reach the caller with their Retry-After header
    server.inject("GET", r"/rayclusters/p1$", 429, retry_after=2)
    server.inject("GET", r"/rayclusters/p1$", 503, retry_after=1)
    for code, after in ((429, "2"), (503, "1")):
        with pytest.raises(AsyncApiException) as exc:
            await api.get_namespaced_custom_object(G, V, NS, "rayclusters", "p1")
        assert exc.value.status == code and exc.value.headers["Retry-After"] == after
    assert (await api.get_namespaced_custom_object(G, V, NS, "rayclusters", "p1"))["metadata"]["name"] == "p1"


def test_sync_patches_and_finalizers(server, custom):
    rc = raycluster("f1")
    rc["metadata"]["finalizers"] = ["example.com/hold"]
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", rc)
    # the sync client sends merge-patch for a dict, JSON patch only when told
    custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f1", {"metadata": {"labels": {"k": "v"}}})
    custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f1",
                                          [{"op": "add", "path": "/metadata/labels/k2", "value": "v2"}],
                                          _content_type="application/json-patch+json")
    got = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f1")
    assert got["metadata"]["labels"] == {"app": "demo", "k": "v", "k2": "v2"}
    with pytest.raises(ApiException) as exc:  # a resourceVersion in a patch is a precondition
        custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f1", {"metadata": {"resourceVersion": "2"}})
    assert exc.value.status == 409

    terminating = custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "f1")
    assert terminating["metadata"]["deletionTimestamp"] and terminating["metadata"]["generation"] == 2
    assert custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f1")["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f1",
                                              {"metadata": {"finalizers": ["example.com/hold", "new/one"]}})
    assert exc.value.status == 422
    custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f1", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as exc:
        custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f1")
    assert exc.value.status == 404


def test_crd_schema_defaulting_and_pruning(tmp_path):
    with FakeKubeApiServer(crd_dir=KUBERAY_SCHEMAS) as srv:
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        api = kconfig.new_client_from_config(config_file=kubeconfig)
        c = kclient.CustomObjectsApi(api)
        rc = raycluster("schema")
        del rc["spec"]["workerGroupSpecs"][0]["numOfHosts"]
        rc["spec"]["bogus"] = 1
        made = c.create_namespaced_custom_object(G, V, NS, "rayclusters", rc)
        assert made["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 1  # CRD default
        assert "bogus" not in made["spec"]  # pruned
        assert made["metadata"]["labels"] == {"app": "demo"}
        assert made["spec"]["workerGroupSpecs"][0]["template"]["metadata"] == {"labels": {"team": "ml"}}
        with pytest.raises(ApiException) as exc:
            c.create_namespaced_custom_object(G, V, NS, "rayclusters", dict(rc, metadata={"name": "strict"}),
                                              field_validation="Strict")
        assert exc.value.status == 400 and 'unknown field "spec.bogus"' in body_of(exc.value)["message"]
        api.close()


# ------------------------------------------------------------------------------------------------
# watches
# ------------------------------------------------------------------------------------------------

def test_watch_resume_replays_missed_events(server, custom):
    rv0 = custom.list_namespaced_custom_object(G, V, NS, "rayclusters")["metadata"]["resourceVersion"]
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("w1"))
    server.set_status("rayclusters", NS, "w1", {"state": "ready"})
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("other", labels={"app": "other"}))
    custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "w1")

    w = kwatch.Watch()
    seen = []
    for ev in w.stream(custom.list_namespaced_custom_object, G, V, NS, "rayclusters",
                       resource_version=rv0, label_selector="app=demo", timeout_seconds=5):
        seen.append((ev["type"], ev["object"]["metadata"]["name"], ev["object"].get("status", {}).get("state")))
        if len(seen) == 3:
            w.stop()
    assert seen == [("ADDED", "w1", None), ("MODIFIED", "w1", "ready"), ("DELETED", "w1", "ready")]

    # a watch without resourceVersion starts with the current state, then ends after timeoutSeconds
    t0 = time.monotonic()
    events = list(kwatch.Watch().stream(custom.list_namespaced_custom_object, G, V, NS, "rayclusters", timeout_seconds=1))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "other")]
    assert 0.9 < time.monotonic() - t0 < 3


async def test_watch_live_selector_transitions_and_410(server, aapi):
    api = aclient.CustomObjectsApi(aapi)
    rv = (await api.list_namespaced_custom_object(G, V, NS, "rayclusters"))["metadata"]["resourceVersion"]
    seen = []

    async def consume():
        async with awatch.Watch().stream(api.list_namespaced_custom_object, G, V, NS, "rayclusters",
                                         resource_version=rv, label_selector="app=demo", timeout_seconds=5) as stream:
            async for ev in stream:
                seen.append((ev["type"], ev["object"]["metadata"]["name"]))
                if len(seen) == 3:
                    return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    await api.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("live"))
    # label no longer matches -> DELETED for this watcher; matches again -> ADDED
    await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "live", {"metadata": {"labels": {"app": "x"}}},
                                             _content_type="application/merge-patch+json")
    await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "live", {"metadata": {"labels": {"app": "demo"}}},
                                             _content_type="application/merge-patch+json")
    await asyncio.wait_for(task, 5)
    assert seen == [("ADDED", "live"), ("DELETED", "live"), ("ADDED", "live")]

    server.compact()
    with pytest.raises(AsyncApiException) as exc:
        async with awatch.Watch().stream(api.list_namespaced_custom_object, G, V, NS, "rayclusters",
                                         resource_version=rv, timeout_seconds=5) as stream:
            async for _ in stream:
                pass
    assert exc.value.status == 410 and "too old resource version" in exc.value.reason
    # the sync client raises it too (no silent retry when timeout_seconds is set)
    sync_api = kconfig.new_client_from_config_dict(server.kubeconfig_dict())
    with pytest.raises(ApiException) as sexc:
        for _ in kwatch.Watch().stream(kclient.CustomObjectsApi(sync_api).list_namespaced_custom_object,
                                       G, V, NS, "rayclusters", resource_version=rv, timeout_seconds=5):
            pass
    sync_api.close()
    assert sexc.value.status == 410


def test_history_limit_expires_old_resource_versions(custom):
    with FakeKubeApiServer(history_limit=3) as small:
        api = kconfig.new_client_from_config_dict(small.kubeconfig_dict())
        c = kclient.CustomObjectsApi(api)
        rv = c.list_namespaced_custom_object(G, V, NS, "rayclusters")["metadata"]["resourceVersion"]
        for i in range(5):
            small.put_object(dict(raycluster(f"h{i}"), metadata={"name": f"h{i}", "namespace": NS}))
        resp = c.list_namespaced_custom_object(G, V, NS, "rayclusters", watch=True, resource_version=rv,
                                               timeout_seconds=2, _preload_content=False)
        lines = [json.loads(line) for line in resp.data.decode().splitlines()]
        api.close()
    assert lines == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: {rv} (4)", "reason": "Expired", "code": 410}}]


async def test_cut_watches_breaks_streams(server, aapi):
    api = aclient.CustomObjectsApi(aapi)
    await api.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("cut"))
    got_first = asyncio.Event()

    async def consume():
        async with awatch.Watch().stream(api.list_namespaced_custom_object, G, V, NS, "rayclusters",
                                         timeout_seconds=10) as stream:
            async for _ in stream:
                got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 5)

    sync_error: list[BaseException] = []

    def sync_watch():
        api_client = kconfig.new_client_from_config_dict(server.kubeconfig_dict())
        try:
            for _ in kwatch.Watch().stream(kclient.CustomObjectsApi(api_client).list_namespaced_custom_object,
                                           G, V, NS, "rayclusters", timeout_seconds=10):
                pass
        except Exception as exc:
            sync_error.append(exc)
        finally:
            api_client.close()

    t = threading.Thread(target=sync_watch)
    t.start()
    await asyncio.to_thread(server.wait_for, lambda: server.open_watches == 2, 5)
    assert server.cut_watches() == 2
    with pytest.raises(Exception) as exc:
        await asyncio.wait_for(task, 5)
    assert "payload is not completed" in str(exc.value).lower() or "ClientPayloadError" in type(exc.value).__name__
    await asyncio.to_thread(t.join, 5)
    assert sync_error and isinstance(sync_error[0], urllib3.exceptions.ProtocolError)


async def test_watch_bookmarks(aapi):
    with FakeKubeApiServer(bookmark_interval=0.1) as srv:
        client = await aconfig.new_client_from_config_dict(srv.kubeconfig_dict())
        api = aclient.CustomObjectsApi(client)
        srv.put_object(raycluster("b1") | {"metadata": {"name": "b1", "namespace": NS}})
        types = []
        async with awatch.Watch().stream(api.list_namespaced_custom_object, G, V, NS, "rayclusters",
                                         allow_watch_bookmarks=True, timeout_seconds=2) as stream:
            async for ev in stream:
                types.append(ev["type"])
                if ev["type"] == "BOOKMARK":
                    assert ev["raw_object"]["metadata"]["resourceVersion"] == srv.resource_version
                    break
        await client.close()
    assert types == ["ADDED", "BOOKMARK"]


# ------------------------------------------------------------------------------------------------
# fault injection and request log
# ------------------------------------------------------------------------------------------------

def test_fault_injection_and_request_log(server, custom):
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("f"))
    server.clear_log()
    server.inject("GET", r"/rayclusters/f$", 503)
    with pytest.raises(ApiException) as exc:
        custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f")
    assert exc.value.status == 503 and body_of(exc.value)["reason"] == "ServiceUnavailable"
    assert custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f")["metadata"]["name"] == "f"

    # urllib3 (under the sync client) retries a GET answered 429 + Retry-After by itself
    server.inject(None, r"/rayclusters$", 429, retry_after=0, times=2)
    custom.list_namespaced_custom_object(G, V, NS, "rayclusters")
    assert server.count("GET", r"/rayclusters$") == 3
    # ... but not a POST
    server.inject("POST", r"/rayclusters$", 429, retry_after=3)
    with pytest.raises(ApiException) as exc:
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("g"))
    assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "3"
    assert body_of(exc.value)["reason"] == "TooManyRequests"
    assert body_of(exc.value)["details"] == {"retryAfterSeconds": 3}

    server.inject("PATCH", r"/rayclusters/f$", 500, body={"kind": "Status", "code": 500, "message": "boom"})
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "f", {"spec": {}})
    assert exc.value.status == 500 and body_of(exc.value)["message"] == "boom"

    server.reset_connection("POST", r"/rayclusters$")
    with pytest.raises(urllib3.exceptions.HTTPError):  # ProtocolError: POST is not retried
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("g"))
    server.reset_connection("GET", r"/rayclusters/f$", times=1)  # urllib3 retries an idempotent GET
    assert custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f")
    server.lose_answers("POST", r"/rayclusters$")  # carried out, but the answer never arrives
    with pytest.raises(urllib3.exceptions.HTTPError):
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("lost"))
    assert server.get_object("rayclusters", NS, "lost") is not None

    verbs = server.counters
    assert verbs["get"] == 4 and verbs["list"] == 3 and verbs["patch"] == 1 and verbs["create"] == 3
    assert server.count("GET", r"/rayclusters/f$") == 4
    method, path, query, is_watch = server.requests[0]
    assert (method, path, is_watch) == ("GET", "/apis/ray.io/v1/namespaces/default/rayclusters/f", False)

    server.latency(0.2)
    t0 = time.monotonic()
    custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "f")
    assert time.monotonic() - t0 >= 0.2
    server.latency(0)


# ------------------------------------------------------------------------------------------------
# the fake KubeRay operator
# ------------------------------------------------------------------------------------------------

def _status(server, name):
    return (server.get_object("rayclusters", NS, name) or {}).get("status") or {}


def test_reactor_makes_multi_host_cluster_ready(server, custom, core, reactor):
    progress: list[int] = []
    unsubscribe = server.on_change(lambda ev: ev.plural == "rayclusters" and progress.append(
        (ev.object.get("status") or {}).get("readyWorkerReplicas", 0)))
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("tpu", replicas=2, hosts=4))
    rc = reactor.wait_ready("tpu")
    unsubscribe()
    st = rc["status"]
    assert st["state"] == "ready"
    assert (st["desiredWorkerReplicas"], st["readyWorkerReplicas"], st["availableWorkerReplicas"]) == (8, 8, 8)
    assert "minWorkerReplicas" not in st and st["maxWorkerReplicas"] == 8  # int32 omitempty: 0 is absent
    assert st["observedGeneration"] == 1 and st["desiredTPU"] == "32" and st["desiredCPU"] == "66"
    assert st["desiredMemory"] == "8Gi" and st["desiredGPU"] == "0"
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["HeadPodReady"]["status"] == "True" and conds["HeadPodReady"]["reason"] == "HeadPodRunningAndReady"
    assert conds["RayClusterProvisioned"]["reason"] == "AllPodRunningAndReadyFirstTime"
    assert st["head"]["serviceName"] == "tpu-head-svc" and st["head"]["podName"].startswith("tpu-head-")
    assert st["endpoints"]["dashboard"] == "8265"
    assert any(0 < n < 8 for n in progress), progress  # readiness was observable host by host

    pods = core.list_namespaced_pod(NS, label_selector="ray.io/cluster=tpu").items
    assert len(pods) == 9 and all(p.status.phase == "Running" and p.spec.node_name for p in pods)
    head = core.list_namespaced_pod(NS, label_selector="ray.io/cluster=tpu,ray.io/node-type=head").items
    assert len(head) == 1 and head[0].metadata.labels["ray.io/group"] == "headgroup"
    workers = core.list_namespaced_pod(NS, label_selector="ray.io/node-type=worker,ray.io/group=tpu-v6e-4x4").items
    assert len(workers) == 8
    by_replica: dict[str, set] = {}
    for w in workers:
        lb = w.metadata.labels
        assert lb["team"] == "ml" and lb["ray.io/worker-group-replica-name"].startswith("tpu-v6e-4x4-")
        by_replica.setdefault(lb["ray.io/worker-group-replica-index"], set()).add(lb["ray.io/replica-host-index"])
        assert w.spec.node_selector["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert w.spec.tolerations[0].key == "google.com/tpu"
        assert w.spec.containers[0].resources.limits == {"google.com/tpu": "4"}
        assert w.metadata.owner_references[0].kind == "RayCluster" and w.metadata.owner_references[0].uid == rc["metadata"]["uid"]
    assert by_replica == {"0": {"0", "1", "2", "3"}, "1": {"0", "1", "2", "3"}}
    svc = core.read_namespaced_service("tpu-head-svc", NS)
    assert {p.name: p.port for p in svc.spec.ports}["dashboard"] == 8265

    # scale down to one slice: the highest replica index goes
    custom.patch_namespaced_custom_object(G, V, NS, "rayclusters", "tpu",
                                          {"spec": {"workerGroupSpecs": [dict(raycluster("tpu")["spec"]["workerGroupSpecs"][0], replicas=1)]}})
    server.wait_for(lambda: _status(server, "tpu").get("readyWorkerReplicas") == 4 and
                    len(reactor.pods("tpu", labels={"ray.io/node-type": "worker"})) == 4)
    assert {p["metadata"]["labels"]["ray.io/worker-group-replica-index"] for p in reactor.pods("tpu", labels={"ray.io/node-type": "worker"})} == {"0"}
    assert _status(server, "tpu")["observedGeneration"] == 2


def test_reactor_hold_unschedulable_then_auto(server, core, reactor):
    reactor.set_mode(hold(), cluster="stuck")
    server.create_object(raycluster("stuck", replicas=1, hosts=2))
    server.wait_for(lambda: len(reactor.pods("stuck")) == 3 and _status(server, "stuck").get("conditions"))
    time.sleep(0.3)  # well past the auto delay
    st = _status(server, "stuck")
    assert "state" not in st and "readyWorkerReplicas" not in st and st["desiredWorkerReplicas"] == 2
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["HeadPodReady"]["status"] == "False"
    assert conds["RayClusterProvisioned"]["reason"] == "RayClusterPodsProvisioning"

    reactor.set_mode(unschedulable(), cluster="stuck")
    server.wait_for(lambda: len(core.list_namespaced_event(NS, field_selector="reason=FailedScheduling").items) == 3)
    ev = core.list_namespaced_event(NS, field_selector="reason=FailedScheduling").items[0]
    assert ev.type == "Warning" and ev.message.startswith("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.")
    assert ev.involved_object.kind == "Pod" and ev.reporting_component == "default-scheduler"
    p = core.read_namespaced_pod(ev.involved_object.name, NS)
    assert p.status.phase == "Pending"
    assert [(c.type, c.status, c.reason) for c in p.status.conditions] == [("PodScheduled", "False", "Unschedulable")]
    assert "state" not in _status(server, "stuck")

    reactor.set_mode(auto(delay=0.05), cluster="stuck")
    assert reactor.wait_ready("stuck")["status"]["readyWorkerReplicas"] == 2


def test_reactor_preempt_drops_and_restores_a_slice(server, reactor):
    server.create_object(raycluster("pre", replicas=2, hosts=4))
    reactor.wait_ready("pre")
    old_names = {p["metadata"]["labels"]["ray.io/worker-group-replica-name"]
                 for p in reactor.pods("pre", labels={"ray.io/worker-group-replica-index": "1"})}
    seen: list[int] = []
    server.on_change(lambda ev: ev.plural == "rayclusters" and seen.append(ev.object["status"].get("readyWorkerReplicas", 0)))

    deleted = reactor.preempt("pre", 1, host_index=2)  # one host lost: KubeRay replaces the whole slice
    assert len(deleted) == 1
    server.wait_for(lambda: 4 in seen)  # the slice's ready count dropped...
    rc = reactor.wait_ready("pre")
    assert rc["status"]["readyWorkerReplicas"] == 8 and rc["status"]["state"] == "ready"  # ...and came back
    slice1 = reactor.pods("pre", labels={"ray.io/worker-group-replica-index": "1"})
    assert len(slice1) == 4
    new_names = {p["metadata"]["labels"]["ray.io/worker-group-replica-name"] for p in slice1}
    assert len(new_names) == 1 and new_names.isdisjoint(old_names)

    # while the slice is down, state stays "ready" (never reset), counts tell the truth
    reactor.set_mode(hold(), cluster="pre")
    reactor.preempt("pre", 0)
    server.wait_for(lambda: len(reactor.pods("pre")) == 9 and _status(server, "pre").get("readyWorkerReplicas") == 4)
    assert _status(server, "pre")["state"] == "ready"


def test_reactor_replica_failure_condition(server, reactor):
    reactor.set_mode(replica_failure(message="pods \"x\" is forbidden: exceeded quota"), cluster="rf")
    server.create_object(raycluster("rf", replicas=1, hosts=2))
    server.wait_for(lambda: any(c["type"] == "ReplicaFailure" for c in _status(server, "rf").get("conditions", [])))
    cond = next(c for c in _status(server, "rf")["conditions"] if c["type"] == "ReplicaFailure")
    assert (cond["status"], cond["reason"]) == ("True", "FailedCreateWorkerPod") and "exceeded quota" in cond["message"]
    assert len(reactor.pods("rf", labels={"ray.io/node-type": "worker"})) == 0
    reactor.clear_mode("rf")
    rc = reactor.wait_ready("rf")
    assert all(c["type"] != "ReplicaFailure" for c in rc["status"]["conditions"])


def test_reactor_delete_removes_pods(server, custom, core):
    with KubeRayReactor(server, delay=0.02, stagger=0.0, delete_delay=0.3) as reactor:
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("del", replicas=1, hosts=2))
        reactor.wait_ready("del")
        assert FINALIZER in server.get_object("rayclusters", NS, "del")["metadata"]["finalizers"]
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "del")
        got = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "del")  # still terminating
        assert got["metadata"]["deletionTimestamp"]
        terminating = server.wait_for(lambda: [p for p in reactor.pods("del") if p["metadata"].get("deletionTimestamp")])
        assert len(terminating) == 3 and server.get_object("rayclusters", NS, "del") is not None
        server.wait_for(lambda: server.get_object("rayclusters", NS, "del") is None, timeout=3)
        assert core.list_namespaced_pod(NS, label_selector="ray.io/cluster=del").items == []
        assert server.get_object("services", NS, "del-head-svc") is None

        reactor.delete_delay = 0
        server.create_object(raycluster("fast", replicas=1, hosts=1))
        reactor.wait_ready("fast")
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "fast")
        server.wait_for(lambda: not reactor.pods("fast"), timeout=2)


async def test_pod_watch_with_field_selector(server, aapi, reactor):
    core = aclient.CoreV1Api(aapi)
    reactor.set_mode(hold())
    await aclient.CustomObjectsApi(aapi).create_namespaced_custom_object(
        G, V, NS, "rayclusters", raycluster("pw", replicas=1, hosts=2))
    running = []

    async def consume():
        async with awatch.Watch().stream(core.list_namespaced_pod, NS, label_selector="ray.io/cluster=pw",
                                         field_selector="status.phase=Running", timeout_seconds=5) as stream:
            async for ev in stream:
                running.append((ev["type"], ev["object"].status.phase))
                if len(running) == 3:
                    return

    task = asyncio.create_task(consume())
    await asyncio.to_thread(server.wait_for, lambda: len(reactor.pods("pw")) == 3)
    assert not running  # Pending pods do not match status.phase=Running
    reactor.set_mode(auto())
    await asyncio.wait_for(task, 5)
    assert running == [("ADDED", "Running")] * 3  # Pending -> Running enters the selection


async def test_rayservice_status_helper(server, aapi, reactor):
    api = aclient.CustomObjectsApi(aapi)
    await api.create_namespaced_custom_object(G, V, NS, "rayservices", {
        "apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "svc"},
        "spec": {"serveConfigV2": "applications: []", "rayClusterConfig": raycluster("x")["spec"]}})
    reactor.set_service_status("svc", conditions={"Ready": False, "UpgradeInProgress": False},
                               active={"app": "DEPLOYING"}, active_cluster="svc-abcde")
    reactor.set_service_status("svc", conditions={"Ready": True}, active={"app": {"status": "RUNNING", "serveDeploymentStatuses": {"D": {"status": "HEALTHY"}}}},
                               pending={"app": "NOT_STARTED"}, num_serve_endpoints=1)
    got = await api.get_namespaced_custom_object_status(G, V, NS, "rayservices", "svc")
    st = got["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "NonZeroServeEndpoints"
    assert conds["UpgradeInProgress"]["status"] == "False"
    assert st["activeServiceStatus"]["applicationStatuses"]["app"]["status"] == "RUNNING"
    assert st["activeServiceStatus"]["rayClusterName"] == "svc-abcde"
    assert st["pendingServiceStatus"]["applicationStatuses"]["app"]["status"] == "NOT_STARTED"
    assert st["numServeEndpoints"] == 1 and st["serviceStatus"] == "Running"
