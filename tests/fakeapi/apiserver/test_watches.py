"""The fake API server's watches with the official clients: resume, selector transitions, 410 after
compaction or past the history limit, cut streams, bookmarks."""

from __future__ import annotations

import asyncio
import json
import threading
import time

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

from tests.support.fake_apiserver.manifests import NS, G, V, raycluster
from tests.support.fake_apiserver.server import FakeKubeApiServer

pytestmark = pytest.mark.timeout(30)


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
    events = list(kwatch.Watch().stream(custom.list_namespaced_custom_object, G, V, NS, "rayclusters",
                                        timeout_seconds=1))
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
