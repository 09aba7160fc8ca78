"""The fake API server's fault injection (errors, resets, lost answers, latency) and request log, as the
official clients see them."""

from __future__ import annotations

import time

import pytest
import urllib3
from kubernetes.client.rest import ApiException

from tests.support.fake_apiserver.manifests import NS, G, V, body_of, raycluster

pytestmark = pytest.mark.timeout(30)


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


def test_an_action_armed_before_a_request_runs_just_before_it_is_served(server, custom):
    """``before`` swaps an object between a client's read and its write; a delete with the read uid is refused."""
    from kubernetes import client as k8s

    read = custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("race"))

    def swap() -> None:
        server.delete_object("rayclusters", NS, "race", force=True)
        server.create_object(raycluster("race"))

    server.before("DELETE", r"/rayclusters/race$", swap)
    checked = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=read["metadata"]["uid"]))
    with pytest.raises(ApiException) as exc:
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "race", body=checked)
    assert exc.value.status == 409 and "Precondition failed: UID in precondition" in body_of(exc.value)["message"]
    survivor = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "race")
    assert survivor["metadata"]["uid"] != read["metadata"]["uid"]
    custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "race")  # disarmed: this one is served as is
    assert server.get_object("rayclusters", NS, "race") is None
