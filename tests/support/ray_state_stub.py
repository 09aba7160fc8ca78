"""A stand-in for Ray's State API node list (``GET /api/v0/nodes``) of several clusters, reached through the
fake API server's service proxy (``url_for(cluster)`` is what to register).

Its nodes are what Ray registers for the cluster's Running pods in the fake API server, by Ray's own
rules (``ray/_private/accelerators/tpu.py``): the head; per TPU host its ``TPU`` chips (KubeRay passes the
``google.com/tpu`` limit as ``--resources``), and, when the pod has ``TPU_NAME`` and ``TPU_WORKER_ID``
(GKE's TPU webhook), the ``ray.io/tpu-slice-name`` and ``ray.io/tpu-worker-id`` labels, a resource named
after the slice and, on worker 0, ``TPU-<pod type>-head``. The answer has the shape Ray 2.60 answers
with (``{"result": true, "msg": "", "data": {"result": {"total", "num_after_truncation", "result"}}}``).
A test hides hosts (:meth:`RayStateStub.hide`: raylets that have not registered) and counts requests.
"""

from __future__ import annotations

import collections
from typing import Any

from aiohttp import web

from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.threaded_app import ThreadedApp


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var.get("value", "")
            for c in pod["spec"].get("containers") or [] for var in c.get("env") or []}


def _chips(pod: dict[str, Any]) -> float:
    return sum(float(((c.get("resources") or {}).get("limits") or {}).get("google.com/tpu") or 0)
               for c in pod["spec"].get("containers") or [])


def ray_node(pod: dict[str, Any], pod_type: str) -> dict[str, Any]:
    """The node Ray lists for one Running pod of a cluster of slices of ``pod_type`` (e.g. ``v6e-16``)."""
    ip = pod["status"]["podIP"]
    head = pod["metadata"]["labels"].get("ray.io/node-type") == "head"
    resources: dict[str, float] = {"CPU": 1.0, f"node:{ip}": 1.0}
    labels = {"ray.io/node-id": f"node-{ip}"}
    if chips := _chips(pod):
        resources["TPU"] = chips
        env = _env(pod)
        if env.get("TPU_NAME") and env.get("TPU_WORKER_ID"):
            resources[env["TPU_NAME"]] = 1.0
            labels.update({"ray.io/tpu-slice-name": env["TPU_NAME"], "ray.io/tpu-worker-id": env["TPU_WORKER_ID"]})
            if env["TPU_WORKER_ID"] == "0":
                resources[f"TPU-{pod_type}-head"] = 1.0
    return {"node_id": f"node-{ip}", "node_ip": ip, "is_head_node": head, "state": "ALIVE", "state_message": None,
            "node_name": ip, "resources_total": resources, "labels": labels}


class RayStateStub(ThreadedApp):
    """Ray's node list of every cluster of ``kube``'s namespace ``namespace``, read from its pods at each request.

    :param kube: the fake API server holding the clusters' pods.
    :param namespace: their namespace.
    :param pod_type: the slices' Ray pod type (``TpuSlice.pod_type``).
    """

    def __init__(self, kube: FakeKubeApiServer, namespace: str, pod_type: str) -> None:
        super().__init__()
        self.kube = kube
        self.namespace = namespace
        self.pod_type = pod_type
        self.hidden: set[str] = set()
        self.dead: list[dict[str, Any]] = []  # nodes of earlier pods, listed as DEAD (as Ray keeps them)
        self.requests: collections.Counter[str] = collections.Counter()

    def url_for(self, cluster: str) -> str:
        return f"{self.url}/{cluster}"

    def hide(self, *pod_names: str) -> None:
        """Leave these pods' raylets out of the list (as if they had not registered); none: show all."""
        self.hidden = set(pod_names)

    async def _nodes(self, request: web.Request) -> web.Response:
        cluster = request.match_info["cluster"]
        self.requests[cluster] += 1
        assert "filter_keys" not in request.query, "Ray counts nodes its GCS filters out as truncated"
        pods = self.kube.list_objects("pods", self.namespace, label_selector=f"ray.io/cluster={cluster}")
        nodes = [ray_node(p, self.pod_type) for p in pods
                 if (p.get("status") or {}).get("phase") == "Running" and p["metadata"]["name"] not in self.hidden]
        nodes += [{**node, "state": "DEAD"} for node in self.dead]
        return web.json_response({"result": True, "msg": "", "data": {"result": {
            "total": len(nodes), "num_after_truncation": len(nodes), "num_filtered": len(nodes), "result": nodes,
            "partial_failure_warning": "", "warnings": None}}})

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{cluster}/api/v0/nodes", self._nodes)
