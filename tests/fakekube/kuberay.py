"""A reactor that plays the KubeRay operator (v1.5-1.7 semantics) against :class:`FakeKubeApiServer`.

It reconciles RayClusters like ``raycluster_controller.go`` does, in miniature: head pod, head
Service ``<name>-head-svc`` (headless, ``dashboard`` port 8265), ``replicas x numOfHosts`` worker
pods per group with the multi-host labels (``ray.io/worker-group-replica-index``,
``ray.io/worker-group-replica-name`` and ``ray.io/replica-host-index``; the last two only when
``numOfHosts > 1``, as upstream), whole-slice deletion and recreation when a host of a slice is
lost, and ``status`` computed like ``calculateStatus`` (``state`` is only ever "ready"/"suspended"
and never reset from "ready"; conditions ``HeadPodReady``, ``RayClusterProvisioned``,
``ReplicaFailure``...).

Pods have no kubelet: the reactor drives their lifecycle according to a *mode* (global or per
cluster): ``auto`` (Running+Ready after ``delay`` s, one host after the other ``stagger`` s apart),
``hold`` (Pending), ``unschedulable(message)`` (Pending, ``PodScheduled=False/Unschedulable`` and a
``FailedScheduling`` Event), ``replica_failure(reason, message)`` (worker pods are not created and
the ``ReplicaFailure`` condition is set).

Everything runs on the server's event loop, driven by its change callbacks and loop timers: no
polling, no busy loop.
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from ._kuberay_modes import (
    DEFAULT_REPLICA_FAILURE_MESSAGE,
    DEFAULT_UNSCHEDULABLE_MESSAGE,
    Mode,
    as_mode,
    auto,
    hold,
    replica_failure,
    unschedulable,
)
from ._kuberay_objects import (
    L_CLUSTER,
    L_GROUP,
    L_HOST_INDEX,
    L_NODE_TYPE,
    L_REPLICA_INDEX,
    L_REPLICA_NAME,
    cluster_event,
    head_service_manifest,
    head_service_name,
    labels_of,
    owned_by,
    pod_manifest,
    rand5,
    running_status,
    scheduling_event,
    unschedulable_status,
)
from ._kuberay_status import condition, desired_replicas, num_hosts, ray_cluster_status, ray_service_status
from ._quantity import format_quantity, parse_quantity
from .server import ApiError, ChangeEvent, FakeKubeApiServer, now_rfc3339, resolve_resource

log = logging.getLogger(__name__)

FINALIZER = "ray.io/fakekube-pod-termination"


class KubeRayReactor:
    """Plays the KubeRay operator for RayClusters stored in ``server``.

    :param server: a started :class:`FakeKubeApiServer`.
    :param delay: seconds until a pod becomes Running+Ready in ``auto`` mode.
    :param stagger: extra seconds between consecutive pods becoming ready (progress is observable).
    :param delete_delay: when > 0, RayClusters get the finalizer ``ray.io/fakekube-pod-termination``;
        a deleted RayCluster keeps existing (with deletionTimestamp, pods terminating) for this long.
    :param mode: the global mode ("auto", "hold", "unschedulable", "replica_failure" or a :class:`Mode`).
    """

    def __init__(self, server: FakeKubeApiServer, *, delay: float = 0.2, stagger: float = 0.02,
                 delete_delay: float = 0.0, mode: str | Mode = "auto"):
        self.server = server
        self.delay = delay
        self.stagger = stagger
        self.delete_delay = delete_delay
        self._mode_lock = threading.Lock()
        self._global_mode = as_mode(mode)
        self._modes: dict[tuple[str, str], Mode] = {}
        # loop-thread-only state
        self._scheduled: set[tuple[str, str]] = set()
        self._timers: dict[tuple[str, str], Any] = {}
        self._teardowns: set[str] = set()
        self._failure_events: set[str] = set()
        self._node_seq = 0
        self._ip_seq = 0
        self._unsubscribe = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "KubeRayReactor":
        if self._unsubscribe is None:
            self._unsubscribe = self.server.on_change(self._on_change)
            for rc in self.server.list_objects("rayclusters"):
                self._schedule_threadsafe(rc["metadata"]["namespace"], rc["metadata"]["name"])
        return self

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

            def cancel() -> None:
                for handle in self._timers.values():
                    handle.cancel()
                self._timers.clear()

            try:
                self.server.call_soon(cancel)
            except (AssertionError, RuntimeError):
                pass

    def __enter__(self) -> "KubeRayReactor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- test controls ---------------------------------------------------------------------------

    def set_mode(self, mode: str | Mode, *, cluster: str | None = None, namespace: str = "default") -> None:
        """Set the global mode (``cluster=None``) or one cluster's; existing pods follow at once."""
        m = as_mode(mode)
        with self._mode_lock:
            if cluster is None:
                self._global_mode = m
            else:
                self._modes[(namespace, cluster)] = m
        self._reconcile_all_threadsafe()

    def clear_mode(self, cluster: str, namespace: str = "default") -> None:
        """Make ``cluster`` follow the global mode again."""
        with self._mode_lock:
            self._modes.pop((namespace, cluster), None)
        self._reconcile_all_threadsafe()

    def mode_for(self, cluster: str, namespace: str = "default") -> Mode:
        with self._mode_lock:
            return self._modes.get((namespace, cluster), self._global_mode)

    def pods(self, cluster: str, namespace: str = "default", labels: Mapping[str, str] | None = None) -> list[dict]:
        """The cluster's pods (labelled ``ray.io/cluster=<cluster>``), optionally filtered by more labels."""
        selector = {L_CLUSTER: cluster, **(labels or {})}
        return self.server.list_objects("pods", namespace, label_selector=selector)

    def preempt(self, cluster: str, replica_index: int, *, group: str | None = None,
                host_index: int | None = None, namespace: str = "default") -> list[str]:
        """Lose a slice (or one host of it, ``host_index``) the way a TPU preemption does: its pods
        vanish; KubeRay then deletes what is left of the slice and recreates the whole slice, which
        becomes ready after ``delay``. Returns the names of the pods deleted here."""
        selector = {L_CLUSTER: cluster, L_NODE_TYPE: "worker", L_REPLICA_INDEX: str(replica_index)}
        if group is not None:
            selector[L_GROUP] = group
        if host_index is not None:
            selector[L_HOST_INDEX] = str(host_index)
        victims = self.server.list_objects("pods", namespace, label_selector=selector)
        if not victims:
            raise LookupError(f"no worker pods of {namespace}/{cluster} match {selector}")
        for pod in victims:
            self.server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
        return [p["metadata"]["name"] for p in victims]

    def wait_ready(self, cluster: str, namespace: str = "default", timeout: float = 5.0) -> dict:
        """Block until the RayCluster is ready with all workers ready; returns it."""
        def ready() -> dict | None:
            rc = self.server.get_object("rayclusters", namespace, cluster)
            st = (rc or {}).get("status") or {}
            if st.get("state") == "ready" and st.get("readyWorkerReplicas", 0) == st.get("desiredWorkerReplicas", 0):
                return rc
            return None

        return self.server.wait_for(ready, timeout)

    # RayService / RayJob status writers (no automatic behaviour) ---------------------------------

    def set_service_status(self, name: str, namespace: str = "default", *,
                           conditions: Mapping[str, Any] | list[dict] | None = None,
                           active: Mapping[str, Any] | None = None,
                           pending: Mapping[str, Any] | None = None,
                           active_cluster: str | None = None, pending_cluster: str | None = None,
                           num_serve_endpoints: int | None = None) -> dict:
        """Write a realistic RayService ``status``.

        ``conditions``: a list of condition dicts, or ``{"Ready": True, "UpgradeInProgress": (False,
        "NoPendingCluster", "msg")}`` (bool or (status, reason[, message])). ``active`` /
        ``pending``: ``{app_name: "RUNNING" | {"status": ..., "message": ..., "serveDeploymentStatuses":
        {...}}}``; ``{}`` clears, None leaves unchanged. Returns the updated RayService."""
        rs = self.server.get_object("rayservices", namespace, name)
        if rs is None:
            raise ApiError.not_found(resolve_resource("rayservices"), name)
        status = ray_service_status(rs, conditions=conditions, active=active, pending=pending,
                                    active_cluster=active_cluster, pending_cluster=pending_cluster,
                                    num_serve_endpoints=num_serve_endpoints)
        return self.server.set_status("rayservices", namespace, name, status)

    def set_job_status(self, name: str, namespace: str = "default", *, job_status: str | None = None,
                       deployment_status: str | None = None, **extra: Any) -> dict:
        """Write a RayJob ``status`` (``jobStatus`` PENDING/RUNNING/STOPPED/SUCCEEDED/FAILED,
        ``jobDeploymentStatus`` Initializing/Running/Complete/Failed/...; ``extra`` merged in)."""
        rj = self.server.get_object("rayjobs", namespace, name)
        if rj is None:
            raise ApiError.not_found(resolve_resource("rayjobs"), name)
        status = copy.deepcopy(rj.get("status") or {})
        if job_status is not None:
            status["jobStatus"] = job_status
        if deployment_status is not None:
            status["jobDeploymentStatus"] = deployment_status
        status.update(copy.deepcopy(extra))
        status["observedGeneration"] = rj["metadata"].get("generation", 1)
        return self.server.set_status("rayjobs", namespace, name, status)

    # -- event plumbing (server loop) ------------------------------------------------------------

    def _schedule_threadsafe(self, namespace: str, name: str) -> None:
        self.server.call_soon(self._schedule, namespace, name)

    def _reconcile_all_threadsafe(self) -> None:
        def all_clusters() -> None:
            for rc in self.server.list_objects("rayclusters"):
                self._schedule(rc["metadata"]["namespace"], rc["metadata"]["name"])

        self.server.call_soon(all_clusters)

    def _schedule(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key not in self._scheduled and self._unsubscribe is not None:
            self._scheduled.add(key)
            self.server.loop.call_soon(self._run_reconcile, key)

    def _on_change(self, ev: ChangeEvent) -> None:
        if ev.plural == "rayclusters":
            if ev.type == "DELETED":
                self._cleanup(ev.namespace, ev.object["metadata"]["uid"])
            self._schedule(ev.namespace, ev.name)
        elif ev.plural in ("pods", "services"):
            cluster = labels_of(ev.object).get(L_CLUSTER)
            if cluster:
                self._schedule(ev.namespace, cluster)

    def _run_reconcile(self, key: tuple[str, str]) -> None:
        self._scheduled.discard(key)
        try:
            self._reconcile(*key)
        except ApiError as exc:  # e.g. a conflicting test write: just try again on the next event
            log.debug("fake kuberay reconcile of %s: %s", key, exc.message)
        except Exception:
            log.exception("fake kuberay reconcile of %s failed", key)

    # -- reconcile -------------------------------------------------------------------------------

    def _reconcile(self, namespace: str, name: str) -> None:
        server = self.server
        rc = server.get_object("rayclusters", namespace, name)
        if rc is None:
            return
        meta = rc["metadata"]
        uid = meta["uid"]
        finalizers = list(meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            self._teardown(rc)
            return
        if self.delete_delay > 0 and FINALIZER not in finalizers:
            server.patch_object("rayclusters", namespace, name, {"metadata": {"finalizers": finalizers + [FINALIZER]}})
            return
        mode = self.mode_for(name, namespace)
        spec = rc.get("spec") or {}
        suspend = spec.get("suspend") is True
        pods = [p for p in self.pods(name, namespace) if owned_by(p, uid)]
        failure: tuple[str, str] | None = None

        if suspend:
            for pod in pods:
                server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
        else:
            self._ensure_head_service(rc)
            heads = [p for p in pods if labels_of(p).get(L_NODE_TYPE) == "head"]
            if not heads:
                server.create_object(pod_manifest(rc, "head", "headgroup", (spec.get("headGroupSpec") or {}).get("template"), {}))
            else:
                for pod in heads:
                    if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                        server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
            for group in spec.get("workerGroupSpecs") or []:
                gname = group.get("groupName", "")
                gpods = [p for p in pods if labels_of(p).get(L_NODE_TYPE) == "worker" and labels_of(p).get(L_GROUP) == gname]
                result = self._reconcile_group(rc, group, gpods, mode)
                if result == "requeue":
                    return  # the deletions come back as events and trigger the next pass
                if result is not None:
                    failure = result
            pods = [p for p in self.pods(name, namespace) if owned_by(p, uid)]
            self._drive_pods(name, pods, mode)

        self._write_status(rc, pods, failure)

    def _reconcile_group(self, rc: dict, group: Mapping, gpods: list[dict], mode: Mode):
        server, ns = self.server, rc["metadata"]["namespace"]
        hosts = num_hosts(group)
        gname = group.get("groupName", "")
        replicas: dict[str, list[dict]] = {}
        for pod in gpods:
            key = labels_of(pod).get(L_REPLICA_NAME) if hosts > 1 else pod["metadata"]["name"]
            replicas.setdefault(key or pod["metadata"]["name"], []).append(pod)
        # 1. incomplete slices (a host was lost) and 2. slices with a failed host: delete the whole slice
        doomed = [pods for pods in replicas.values()
                  if len(pods) < hosts or any((p.get("status") or {}).get("phase") in ("Failed", "Succeeded") for p in pods)]
        if doomed:
            for pods in doomed:
                for pod in pods:
                    server.delete_object("pods", ns, pod["metadata"]["name"], force=True)
            return "requeue"
        desired = desired_replicas(group) // hosts
        index_of = {k: int(labels_of(v[0]).get(L_REPLICA_INDEX, "0") or 0) for k, v in replicas.items()}
        if len(replicas) < desired:
            if mode.kind == "replica_failure":
                pod_name = f"{rc['metadata']['name']}-{gname}-worker-{rand5()}"
                return (mode.reason, mode.message.replace("{pod}", pod_name))
            used = set(index_of.values())
            for _ in range(desired - len(replicas)):
                index = next(i for i in range(len(used) + 1) if i not in used)
                used.add(index)
                replica_name = f"{gname}-{rand5()}"
                for host in range(hosts):
                    extra = {L_REPLICA_INDEX: str(index)}
                    if hosts > 1:
                        extra[L_REPLICA_NAME] = replica_name
                        extra[L_HOST_INDEX] = str(host)
                    server.create_object(pod_manifest(rc, "worker", gname, group.get("template"), extra))
        elif len(replicas) > desired:
            for key in sorted(replicas, key=lambda k: index_of[k], reverse=True)[: len(replicas) - desired]:
                for pod in replicas[key]:
                    server.delete_object("pods", ns, pod["metadata"]["name"], force=True)
        return None

    # -- pods ------------------------------------------------------------------------------------

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
        pool = (spec.get("nodeSelector") or {}).get("cloud.google.com/gke-nodepool") or ("tpu-pool" if tpu else "default-pool")
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

    # -- deletion --------------------------------------------------------------------------------

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

    # -- status ----------------------------------------------------------------------------------

    def _write_status(self, rc: dict, pods: list[dict], failure: tuple[str, str] | None) -> None:
        meta = rc["metadata"]
        if failure is not None:
            reason, message = failure
            if meta["uid"] + reason not in self._failure_events:
                self._failure_events.add(meta["uid"] + reason)
                self.server.create_object(cluster_event(rc, "Warning", "FailedToCreateWorkerPod",
                                                        f"Failed to create worker Pod: {message}"))
        else:
            self._failure_events = {k for k in self._failure_events if not k.startswith(meta["uid"])}
        status = ray_cluster_status(rc, pods, failure, self._head_service(rc))
        if status is not None:
            self.server.set_status("rayclusters", meta["namespace"], meta["name"], status)

    def _head_service(self, rc: dict) -> dict | None:
        meta = rc["metadata"]
        for svc in self.server.list_objects("services", meta["namespace"],
                                            label_selector={L_CLUSTER: meta["name"], L_NODE_TYPE: "head"}):
            if owned_by(svc, meta["uid"]):
                return svc
        return None


__all__ = [
    "DEFAULT_REPLICA_FAILURE_MESSAGE",
    "DEFAULT_UNSCHEDULABLE_MESSAGE",
    "FINALIZER",
    "KubeRayReactor",
    "Mode",
    "auto",
    "format_quantity",
    "hold",
    "parse_quantity",
    "replica_failure",
    "unschedulable",
]
