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

This module holds the reactor's lifecycle, test controls, event plumbing and the reconcile of one
RayCluster; the rest are mixins of their own: ``_kuberay_slices`` (a worker group's slices),
``_kuberay_pods`` (pod lifecycle and deletion) and ``_kuberay_writers`` (status writes).
"""

from __future__ import annotations

import logging
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
    labels_of,
    owned_by,
    pod_manifest,
)
from ._kuberay_pods import FINALIZER, PodLifecycle
from ._kuberay_slices import SliceReconciler
from ._kuberay_writers import StatusWriters
from ._quantity import format_quantity, parse_quantity
from .server import ApiError, ChangeEvent, FakeKubeApiServer

log = logging.getLogger(__name__)


class KubeRayReactor(PodLifecycle, SliceReconciler, StatusWriters):
    """Plays the KubeRay operator for RayClusters stored in ``server``.

    :param server: a started :class:`FakeKubeApiServer`.
    :param delay: seconds until a pod becomes Running+Ready in ``auto`` mode.
    :param stagger: extra seconds between consecutive pods becoming ready (progress is observable).
    :param delete_delay: when > 0, RayClusters get the finalizer ``ray.io/fakekube-pod-termination``;
        a deleted RayCluster keeps existing (with deletionTimestamp, pods terminating) for this long.
    :param mode: the global mode ("auto", "hold", "unschedulable", "replica_failure" or a :class:`Mode`).
    :param tpu_webhook: give TPU host pods the variables GKE's TPU webhook adds when they are created.
    """

    def __init__(self, server: FakeKubeApiServer, *, delay: float = 0.2, stagger: float = 0.02,
                 delete_delay: float = 0.0, mode: str | Mode = "auto", tpu_webhook: bool = False):
        self.server = server
        #: Give TPU host pods what GKE's TPU webhook adds when they are created.
        self.tpu_webhook = tpu_webhook
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

    def start(self) -> KubeRayReactor:
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

    def __enter__(self) -> KubeRayReactor:
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
                server.create_object(pod_manifest(rc, "head", "headgroup",
                                                  (spec.get("headGroupSpec") or {}).get("template"), {}))
            else:
                for pod in heads:
                    if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                        server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
            for group in spec.get("workerGroupSpecs") or []:
                gname = group.get("groupName", "")
                gpods = [p for p in pods
                         if labels_of(p).get(L_NODE_TYPE) == "worker" and labels_of(p).get(L_GROUP) == gname]
                result = self._reconcile_group(rc, group, gpods, mode)
                if result == "requeue":
                    return  # the deletions come back as events and trigger the next pass
                if result is not None:
                    failure = result
            pods = [p for p in self.pods(name, namespace) if owned_by(p, uid)]
            self._drive_pods(name, pods, mode)

        self._write_status(rc, pods, failure)

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
