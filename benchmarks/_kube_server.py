"""The fake Kubernetes API server as a process of its own, with N RayClusters waiting to turn ready.

Used by ``triggerer_capacity.py``: the server (tests/support/fake_apiserver, real HTTP or HTTPS with a cluster
CA in the kubeconfig) runs in a separate process so its work does not land on the measured event
loop (the two processes still share the machine's cores). The RayClusters (v6e 2x2: head + one
host) are stamped from a template the KubeRay reactor made pending; at the switch the server
writes every cluster's ready state as the reactor produced it for the template (pods
Running+Ready, then the RayCluster status). Reconciling 1000 clusters through the reactor itself
is O(clusters^2) in the fake and would dominate the run.

Commands over a pipe: ``open_watches``, ``requests``, ``connections``, ``end_watches`` (as at
``timeoutSeconds``), ``restart`` (every watch cut and connection closed, state kept), ``flip``
(every cluster ready; answers the switch time), ``ready_times``, ``stop``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import _common

NS = _common.NAMESPACE


def _stamp_pod(template: dict, cluster: str, uid: str, template_cluster: str) -> dict:
    """A copy of one of the template cluster's pods, for ``cluster`` (name, labels, owner)."""
    pod = copy.deepcopy(template)
    meta = pod["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generateName"):
        meta.pop(key, None)
    meta["name"] = meta["name"].replace(template_cluster, cluster, 1)
    meta["labels"] = {k: (v.replace(template_cluster, cluster, 1) if isinstance(v, str) else v)
                      for k, v in (meta.get("labels") or {}).items()}
    for ref in meta.get("ownerReferences") or []:
        ref["name"], ref["uid"] = cluster, uid
    return pod


def server_main(conn: Any, clusters: int, delay: float, tls: bool, bookmark_interval: float | None = 60.0) -> None:
    """The fake API server's process (see the module docstring)."""
    _common.raise_fd_limit()
    _common.quiet_logs()
    from tests.support.fake_apiserver.kuberay import KubeRayReactor
    from tests.support.fake_apiserver.server import FakeKubeApiServer

    ready_at: dict[str, float] = {}
    tmpl = "tmpl"

    def on_change(ev: Any) -> None:
        if _common.is_ready_commit(ev):
            ready_at.setdefault(ev.name, time.time())

    def pods_of(name: str) -> list[dict]:
        return server.list_objects("pods", NS, label_selector={"ray.io/cluster": name})

    with FakeKubeApiServer(history_limit=100_000, tls=tls, bookmark_interval=bookmark_interval) as server:
        with KubeRayReactor(server, delay=delay, stagger=0.0, mode="hold") as reactor:
            server.create_object(_common.cluster_manifest(tmpl, topology="2x2"))
            server.wait_for(lambda: len(pods_of(tmpl)) == 2 and (
                (server.get_object("rayclusters", NS, tmpl) or {}).get("status") or {}).get("conditions"), timeout=60)
            time.sleep(0.2)
            pending_status = server.get_object("rayclusters", NS, tmpl)["status"]
            pending_pods = {p["metadata"]["labels"]["ray.io/node-type"]: p for p in pods_of(tmpl)}
            reactor.set_mode("auto", cluster=tmpl, namespace=NS)
            reactor.wait_ready(tmpl, NS, timeout=60)
            time.sleep(0.2)
            ready_status = server.get_object("rayclusters", NS, tmpl)["status"]
            ready_pods = {p["metadata"]["labels"]["ray.io/node-type"]: p["status"] for p in pods_of(tmpl)}
        # the reactor is stopped: nothing but this process writes from here on
        server.delete_object("rayclusters", NS, tmpl, force=True)
        for pod in pods_of(tmpl):
            server.delete_object("pods", NS, pod["metadata"]["name"], force=True)
        server.on_change(on_change)
        stamped: dict[str, list[tuple[str, str]]] = {}
        for i in range(clusters):
            name = f"rc-{i:04d}"
            rc = server.create_object(_common.cluster_manifest(name, topology="2x2"))
            server.set_status("rayclusters", NS, name, pending_status)
            stamped[name] = []
            for node_type, template in pending_pods.items():
                pod = server.put_object(_stamp_pod(template, name, rc["metadata"]["uid"], tmpl))
                stamped[name].append((pod["metadata"]["name"], node_type))
        conn.send(("ready", server.airflow_connection(NS)))
        while True:
            cmd, *rest = conn.recv()
            if cmd == "open_watches":
                conn.send(server.open_watches)
            elif cmd == "requests":
                conn.send(dict(server.counters))
            elif cmd == "connections":
                conn.send({"open": server.open_connections, "opened": server.connections_opened})
            elif cmd == "end_watches":
                server.end_watches()
                conn.send(time.time())
            elif cmd == "restart":
                conn.send((time.time(), server.drop_connections()))
            elif cmd == "flip":
                conn.send(time.time())
                for name, pods in stamped.items():
                    for pod_name, node_type in pods:
                        server.set_status("pods", NS, pod_name, ready_pods[node_type])
                    server.set_status("rayclusters", NS, name, ready_status)
            elif cmd == "ready_times":
                conn.send(dict(ready_at))
            elif cmd == "stop":
                conn.send("bye")
                break
