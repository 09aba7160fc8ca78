"""The fake API server's API semantics with the official clients over HTTP: discovery and auth, CRUD and
Status bodies, selectors, the service proxy, the status subresource, patch types, finalizers, CRD schemas."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.rest import ApiException
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from tests.support.fake_apiserver.manifests import NS, G, V, body_of, pod, raycluster
from tests.support.fake_apiserver.server import KUBERAY_SCHEMAS, FakeKubeApiServer

pytestmark = pytest.mark.timeout(30)


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
    created = custom.create_namespaced_custom_object(G, V, NS, "rayclusters",
                                                     dict(raycluster("c1"), status={"state": "ready"}))
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
    assert listed["kind"] == "RayClusterList" and [i["metadata"]["name"] for i in listed["items"]] == [
        "c1", made["metadata"]["name"]]
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
    assert json.loads(exc.value.body)["message"] == (
        "json: cannot unmarshal object into Go value of type jsonpatch.Patch")

    merged = await api.patch_namespaced_custom_object(
        G, V, NS, "rayclusters", "p1", {"metadata": {"labels": {"x": "1", "app": None}}},
        _content_type="application/merge-patch+json")
    assert merged["metadata"]["labels"] == {"x": "1"}

    ops = [{"op": "test", "path": "/metadata/labels/x", "value": "1"},
           {"op": "add", "path": "/metadata/annotations", "value": {"a/b": "c"}},
           {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 1},
           {"op": "remove", "path": "/metadata/labels/x"}]
    jp = await api.patch_namespaced_custom_object(G, V, NS, "rayclusters", "p1", ops)
    assert (jp["metadata"]["annotations"] == {"a/b": "c"} and "labels" not in jp["metadata"]
            or jp["metadata"]["labels"] == {})
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
