"""The pods of :class:`tests.support.fake_apiserver.kuberay.KubeRayReactor`'s RayClusters, as KubeRay and the
kubelet would move them: the head Service, Pending pods made Running + Ready (or Unschedulable) as the mode says, and
on deletion the pods terminating until the finalizer :data:`FINALIZER` is removed.

A mixin: the reactor owns the server, the timers and the counters it uses; everything runs on the
server's loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from ._kuberay_modes import Mode
from ._kuberay_objects import (
    L_CLUSTER,
    L_GROUP,
    L_HOST_INDEX,
    L_NODE_TYPE,
    L_REPLICA_INDEX,
    head_service_manifest,
    head_service_name,
    labels_of,
    owned_by,
    running_status,
    scheduling_event,
    unschedulable_status,
)
from ._kuberay_status import condition
from ._resources import now_rfc3339
from .server import FakeKubeApiServer

FINALIZER = "ray.io/fakekube-pod-termination"


class PodLifecycle:
    """The reactor's pod lifecycle timers and deletion (``_drive_pods``, ``_teardown``, ``_cleanup``)."""

    server: FakeKubeApiServer
    delay: float
    stagger: float
    delete_delay: float
    mode_for: Callable[..., Mode]
    _timers: dict[tuple[str, str], Any]
    _teardowns: set[str]
    _node_seq: int
    _ip_seq: int

    def _ensure_head_service(self, rc: dict) -> None:
        if self.server.get_object("services", rc["metadata"]["namespace"], head_service_name(rc)) is None:
            self.server.create_object(head_service_manifest(rc))

    def _drive_pods(self, cluster: str, pods: list[dict], mode: Mode) -> None:
        """Move Pending pods along according to the mode (timers for auto, conditions otherwise)."""
        order = sorted(pods, key=lambda p: (labels_of(p).get(L_NODE_TYPE) != "head", labels_of(p).get(L_GROUP, ""),
                                            int(labels_of(p).get(L_REPLICA_INDEX, "0") or 0),
                                            int(labels_of(p).get(L_HOST_INDEX, "0") or 0), p["metadata"]["name"]))
        n_new = 0
        for pod in order:
            meta, status = pod["metadata"], pod.get("status") or {}
            key = (meta["namespace"], meta["name"])
            if status.get("phase") != "Pending" or meta.get("deletionTimestamp"):
                continue
            if mode.kind in ("auto", "replica_failure"):
                if key not in self._timers:
                    delay = mode.delay if mode.delay is not None else self.delay
                    stagger = mode.stagger if mode.stagger is not None else self.stagger
                    self._timers[key] = self.server.loop.call_later(
                        delay + stagger * n_new, self._make_ready, key, meta["uid"])
                    n_new += 1
                continue
            timer = self._timers.pop(key, None)
            if timer is not None:
                timer.cancel()
            if mode.kind == "unschedulable":
                self._mark_unschedulable(pod, mode.message)

    def _make_ready(self, key: tuple[str, str], uid: str) -> None:
        self._timers.pop(key, None)
        pod = self.server.get_object("pods", *key)
        if pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp"):
            return
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            return
        cluster = labels_of(pod).get(L_CLUSTER, "")
        if self.mode_for(cluster, key[0]).kind not in ("auto", "replica_failure"):
            return
        self._node_seq += 1
        self._ip_seq += 1
        spec = pod.setdefault("spec", {})
        resources = [c.get("resources") or {} for c in spec.get("containers") or []]
        tpu = any("google.com/tpu" in (r.get("limits") or {}) or "google.com/tpu" in (r.get("requests") or {})
                  for r in resources)
        pool = ((spec.get("nodeSelector") or {}).get("cloud.google.com/gke-nodepool")
                or ("tpu-pool" if tpu else "default-pool"))
        spec["nodeName"] = f"gke-fake-{pool}-{secrets.token_hex(2)}-{self._node_seq:04d}"
        host_ip = f"10.128.{self._ip_seq // 250}.{self._ip_seq % 250 + 2}"
        pod_ip = f"10.4.{self._ip_seq // 250}.{self._ip_seq % 250 + 2}"
        pod["status"] = running_status(pod, host_ip, pod_ip)
        self.server.put_object(pod)

    def _mark_unschedulable(self, pod: dict, message: str) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        current = condition(status.get("conditions") or [], "PodScheduled")
        if current and current.get("reason") == "Unschedulable" and current.get("message") == message:
            return
        self.server.set_status("pods", meta["namespace"], meta["name"], unschedulable_status(pod, message))
        self.server.create_object(scheduling_event(pod, message))

    def _cleanup(self, namespace: str, uid: str) -> None:
        for plural in ("pods", "services"):
            for obj in self.server.list_objects(plural, namespace):
                if owned_by(obj, uid):
                    key = (namespace, obj["metadata"]["name"])
                    timer = self._timers.pop(key, None)
                    if timer is not None:
                        timer.cancel()
                    self.server.delete_object(plural, namespace, obj["metadata"]["name"], force=True)

    def _teardown(self, rc: dict) -> None:
        meta = rc["metadata"]
        uid, ns, name = meta["uid"], meta["namespace"], meta["name"]
        if FINALIZER not in (meta.get("finalizers") or []) or uid in self._teardowns:
            return
        self._teardowns.add(uid)
        ts = now_rfc3339()
        for pod in self.server.list_objects("pods", ns):
            if owned_by(pod, uid) and not pod["metadata"].get("deletionTimestamp"):
                pod["metadata"]["deletionTimestamp"] = ts
                pod["metadata"]["deletionGracePeriodSeconds"] = 30
                self.server.put_object(pod)

        def finish() -> None:
            self._teardowns.discard(uid)
            self._cleanup(ns, uid)
            current = self.server.get_object("rayclusters", ns, name)
            if current is not None and current["metadata"]["uid"] == uid:
                remaining = [f for f in current["metadata"].get("finalizers") or [] if f != FINALIZER]
                self.server.patch_object("rayclusters", ns, name, {"metadata": {"finalizers": remaining}})

        self.server.loop.call_later(max(self.delete_delay, 0.0), finish)
