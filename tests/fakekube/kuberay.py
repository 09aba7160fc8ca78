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
import datetime as _dt
import logging
import random
import secrets
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Iterable, Mapping

from .server import ApiError, ChangeEvent, FakeKubeApiServer, now_rfc3339, resolve_resource

log = logging.getLogger(__name__)

FINALIZER = "ray.io/fakekube-pod-termination"
DEFAULT_UNSCHEDULABLE_MESSAGE = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
DEFAULT_REPLICA_FAILURE_MESSAGE = (
    'pods "{pod}" is forbidden: exceeded quota: tpu-quota, requested: google.com/tpu=4, '
    "used: google.com/tpu=0, limited: google.com/tpu=0"
)

L_CLUSTER = "ray.io/cluster"
L_NODE_TYPE = "ray.io/node-type"
L_GROUP = "ray.io/group"
L_REPLICA_INDEX = "ray.io/worker-group-replica-index"
L_REPLICA_NAME = "ray.io/worker-group-replica-name"
L_HOST_INDEX = "ray.io/replica-host-index"
_RAND_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_INT32 = 2147483647


# ------------------------------------------------------------------------------------------------
# Modes
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    """How the fake cluster treats pods: see :func:`auto`, :func:`hold`, :func:`unschedulable`,
    :func:`replica_failure`."""

    kind: str
    delay: float | None = None
    stagger: float | None = None
    reason: str = ""
    message: str = ""


def auto(delay: float | None = None, stagger: float | None = None) -> Mode:
    """Pods become Running+Ready ``delay`` s after creation (default: the reactor's), the n-th
    pending pod of a reconcile pass ``n * stagger`` s later."""
    return Mode("auto", delay=delay, stagger=stagger)


def hold() -> Mode:
    """Pods stay Pending (no scheduling decision yet)."""
    return Mode("hold")


def unschedulable(message: str = DEFAULT_UNSCHEDULABLE_MESSAGE) -> Mode:
    """Pods stay Pending with ``PodScheduled=False`` (reason Unschedulable) and a core Event
    ``FailedScheduling`` carrying ``message``."""
    return Mode("unschedulable", reason="Unschedulable", message=message)


def replica_failure(reason: str = "FailedCreateWorkerPod", message: str | None = None) -> Mode:
    """Worker pods cannot be created: condition ``ReplicaFailure`` True with ``reason``/``message``.
    ``message`` may contain ``{pod}`` (a would-be worker pod name)."""
    return Mode("replica_failure", reason=reason, message=message or DEFAULT_REPLICA_FAILURE_MESSAGE)


_NAMED_MODES = {"auto": auto, "hold": hold, "unschedulable": unschedulable, "replica_failure": replica_failure}


def _as_mode(mode: str | Mode) -> Mode:
    if isinstance(mode, Mode):
        return mode
    try:
        return _NAMED_MODES[mode]()
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; one of {sorted(_NAMED_MODES)}") from None


# ------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------

_SUFFIXES = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(q: Any) -> tuple[Decimal, bool]:
    """A Kubernetes quantity -> (value, is_binary_suffix)."""
    s = str(q).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            try:
                return Decimal(s[: -len(suffix)]) * _SUFFIXES[suffix], suffix.endswith("i")
            except InvalidOperation:
                break
    try:
        return Decimal(s), False
    except InvalidOperation:
        return Decimal(0), False


def format_quantity(value: Decimal, binary: bool) -> str:
    """Best-effort canonical form (what Quantity.String() prints for the usual cases)."""
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        v = int(value)
        units = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)) if binary \
            else (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))
        for suffix, mult in units:
            if v % mult == 0:
                return f"{v // mult}{suffix}"
        return str(v)
    milli = value * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return str(value)


def _rand5() -> str:
    return "".join(random.choice(_RAND_ALPHABET) for _ in range(5))


def _labels(obj: Mapping) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def _owned_by(obj: Mapping, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def _is_running_and_ready(pod: Mapping) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _all_pods_running(pods: list[dict]) -> bool:
    """utils.CheckAllPodsRunning."""
    if not pods:
        return False
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Running":
            return False
        for c in status.get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") != "True":
                return False
    return True


def _set_condition(conditions: list[dict], type_: str, status: str, reason: str, message: str = "") -> None:
    """meta.SetStatusCondition: lastTransitionTime changes only when status changes."""
    for c in conditions:
        if c.get("type") == type_:
            if c.get("status") != status:
                c["status"] = status
                c["lastTransitionTime"] = now_rfc3339()
            c["reason"] = reason
            c["message"] = message
            return
    conditions.append({"type": type_, "status": status, "lastTransitionTime": now_rfc3339(),
                       "reason": reason, "message": message})


def _remove_condition(conditions: list[dict], type_: str) -> None:
    conditions[:] = [c for c in conditions if c.get("type") != type_]


def _condition(conditions: Iterable[Mapping], type_: str) -> Mapping | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def _desired_replicas(group: Mapping) -> int:
    """utils.GetWorkerGroupDesiredReplicas, in pods (replicas x numOfHosts)."""
    if group.get("suspend") is True:
        return 0
    lo = int(group.get("minReplicas") or 0)
    hi = int(group.get("maxReplicas") if group.get("maxReplicas") is not None else _MAX_INT32)
    replicas = group.get("replicas")
    if replicas is None or int(replicas) < lo:
        n = lo
    elif int(replicas) > hi:
        n = hi
    else:
        n = int(replicas)
    return n * _num_hosts(group)


def _num_hosts(group: Mapping) -> int:
    return max(1, int(group.get("numOfHosts") or 1))


def _micro_time() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ------------------------------------------------------------------------------------------------
# The reactor
# ------------------------------------------------------------------------------------------------

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
        self._global_mode = _as_mode(mode)
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
        m = _as_mode(mode)
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
        status = copy.deepcopy(rs.get("status") or {})
        if conditions is not None:
            conds = status.setdefault("conditions", [])
            if isinstance(conditions, list):
                status["conditions"] = copy.deepcopy(conditions)
            else:
                defaults = {("Ready", "True"): "NonZeroServeEndpoints", ("Ready", "False"): "ZeroServeEndpoints",
                            ("UpgradeInProgress", "True"): "BothActivePendingClustersExist",
                            ("UpgradeInProgress", "False"): "NoPendingCluster"}
                for type_, spec in conditions.items():
                    if isinstance(spec, tuple):
                        flag, reason, *rest = spec
                        message = rest[0] if rest else ""
                    else:
                        flag, reason, message = spec, None, ""
                    st = flag if isinstance(flag, str) else ("True" if flag else "False")
                    _set_condition(conds, type_, st, reason or defaults.get((type_, st), type_), message)
        for key, apps, cluster_name in (("activeServiceStatus", active, active_cluster),
                                        ("pendingServiceStatus", pending, pending_cluster)):
            section = status.setdefault(key, {})
            if apps is not None:
                section["applicationStatuses"] = {
                    app: ({"status": v, "serveDeploymentStatuses": {}} if isinstance(v, str) else copy.deepcopy(dict(v)))
                    for app, v in apps.items()
                }
                if not apps:
                    section.pop("applicationStatuses")
            if cluster_name is not None:
                section["rayClusterName"] = cluster_name
        if num_serve_endpoints is not None:
            if num_serve_endpoints:
                status["numServeEndpoints"] = num_serve_endpoints
            else:
                status.pop("numServeEndpoints", None)
        ready = _condition(status.get("conditions") or [], "Ready")
        if ready is not None:  # deprecated mirror of the Ready condition
            status["serviceStatus"] = "Running" if ready.get("status") == "True" else ""
            if not status["serviceStatus"]:
                status.pop("serviceStatus")
        status["observedGeneration"] = rs["metadata"].get("generation", 1)
        status["lastUpdateTime"] = now_rfc3339()
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
            cluster = _labels(ev.object).get(L_CLUSTER)
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
        pods = [p for p in self.pods(name, namespace) if _owned_by(p, uid)]
        failure: tuple[str, str] | None = None

        if suspend:
            for pod in pods:
                server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
        else:
            self._ensure_head_service(rc)
            heads = [p for p in pods if _labels(p).get(L_NODE_TYPE) == "head"]
            if not heads:
                server.create_object(self._pod_manifest(rc, "head", "headgroup", (spec.get("headGroupSpec") or {}).get("template"), {}))
            else:
                for pod in heads:
                    if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                        server.delete_object("pods", namespace, pod["metadata"]["name"], force=True)
            for group in spec.get("workerGroupSpecs") or []:
                gname = group.get("groupName", "")
                gpods = [p for p in pods if _labels(p).get(L_NODE_TYPE) == "worker" and _labels(p).get(L_GROUP) == gname]
                result = self._reconcile_group(rc, group, gpods, mode)
                if result == "requeue":
                    return  # the deletions come back as events and trigger the next pass
                if result is not None:
                    failure = result
            pods = [p for p in self.pods(name, namespace) if _owned_by(p, uid)]
            self._drive_pods(name, pods, mode)

        self._write_status(rc, pods, failure)

    def _reconcile_group(self, rc: dict, group: Mapping, gpods: list[dict], mode: Mode):
        server, ns = self.server, rc["metadata"]["namespace"]
        hosts = _num_hosts(group)
        gname = group.get("groupName", "")
        replicas: dict[str, list[dict]] = {}
        for pod in gpods:
            key = _labels(pod).get(L_REPLICA_NAME) if hosts > 1 else pod["metadata"]["name"]
            replicas.setdefault(key or pod["metadata"]["name"], []).append(pod)
        # 1. incomplete slices (a host was lost) and 2. slices with a failed host: delete the whole slice
        doomed = [pods for pods in replicas.values()
                  if len(pods) < hosts or any((p.get("status") or {}).get("phase") in ("Failed", "Succeeded") for p in pods)]
        if doomed:
            for pods in doomed:
                for pod in pods:
                    server.delete_object("pods", ns, pod["metadata"]["name"], force=True)
            return "requeue"
        desired = _desired_replicas(group) // hosts
        index_of = {k: int(_labels(v[0]).get(L_REPLICA_INDEX, "0") or 0) for k, v in replicas.items()}
        if len(replicas) < desired:
            if mode.kind == "replica_failure":
                pod_name = f"{rc['metadata']['name']}-{gname}-worker-{_rand5()}"
                return (mode.reason, mode.message.replace("{pod}", pod_name))
            used = set(index_of.values())
            for _ in range(desired - len(replicas)):
                index = next(i for i in range(len(used) + 1) if i not in used)
                used.add(index)
                replica_name = f"{gname}-{_rand5()}"
                for host in range(hosts):
                    extra = {L_REPLICA_INDEX: str(index)}
                    if hosts > 1:
                        extra[L_REPLICA_NAME] = replica_name
                        extra[L_HOST_INDEX] = str(host)
                    server.create_object(self._pod_manifest(rc, "worker", gname, group.get("template"), extra))
        elif len(replicas) > desired:
            for key in sorted(replicas, key=lambda k: index_of[k], reverse=True)[: len(replicas) - desired]:
                for pod in replicas[key]:
                    server.delete_object("pods", ns, pod["metadata"]["name"], force=True)
        return None

    # -- pods ------------------------------------------------------------------------------------

    def _pod_manifest(self, rc: dict, node_type: str, group: str, template: Mapping | None,
                      extra_labels: Mapping[str, str]) -> dict:
        name, ns = rc["metadata"]["name"], rc["metadata"]["namespace"]
        tmpl = copy.deepcopy(dict(template or {}))
        tmeta = tmpl.get("metadata") or {}
        labels = {
            "ray.io/is-ray-node": "yes", L_CLUSTER: name, L_NODE_TYPE: node_type, L_GROUP: group,
            "ray.io/identifier": f"{name}-{node_type}"[:63],
            "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator",
        }
        for k, v in (tmeta.get("labels") or {}).items():
            if k not in (L_NODE_TYPE, L_GROUP, L_CLUSTER):
                labels[k] = v
        labels.update(extra_labels)
        annotations = dict(tmeta.get("annotations") or {})
        annotations.setdefault("ray.io/ft-enabled", "false")
        prefix = name if node_type == "head" else f"{name}-{group}"
        spec = copy.deepcopy(tmpl.get("spec") or {})
        spec.setdefault("containers", [{"name": f"ray-{node_type}", "image": "rayproject/ray"}])
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "generateName": f"{prefix[:50]}-{node_type}-".lower(),
                "namespace": ns, "labels": labels, "annotations": annotations,
                "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": name,
                                     "uid": rc["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": spec,
        }

    def _ensure_head_service(self, rc: dict) -> None:
        name, ns = rc["metadata"]["name"], rc["metadata"]["namespace"]
        head = (rc.get("spec") or {}).get("headGroupSpec") or {}
        svc_name = ((head.get("headService") or {}).get("metadata") or {}).get("name") or f"{name}-head-svc"
        if self.server.get_object("services", ns, svc_name) is not None:
            return
        containers = ((head.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        ports = {p.get("name") or f"{p['containerPort']}-port": p["containerPort"]
                 for p in containers[0].get("ports") or [] if p.get("containerPort")}
        if not ports:
            ports = {"client": 10001, "dashboard": 8265, "gcs-server": 6379, "serve": 8000}
        ports.setdefault("metrics", 8080)
        selector = {L_CLUSTER: name, L_NODE_TYPE: "head", "ray.io/identifier": f"{name}-head"[:63],
                    "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
        service_type = head.get("serviceType") or "ClusterIP"
        spec: dict[str, Any] = {
            "selector": selector, "type": service_type,
            "ports": [{"name": n, "port": p, "appProtocol": "tcp"} for n, p in sorted(ports.items())],
        }
        if service_type == "ClusterIP":
            spec["clusterIP"] = "None"
            spec["publishNotReadyAddresses"] = True
        self.server.create_object({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc_name, "namespace": ns, "labels": dict(selector),
                         "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": name,
                                              "uid": rc["metadata"]["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": spec,
        })

    def _drive_pods(self, cluster: str, pods: list[dict], mode: Mode) -> None:
        """Move Pending pods along according to the mode (timers for auto, conditions otherwise)."""
        order = sorted(pods, key=lambda p: (_labels(p).get(L_NODE_TYPE) != "head", _labels(p).get(L_GROUP, ""),
                                            int(_labels(p).get(L_REPLICA_INDEX, "0") or 0),
                                            int(_labels(p).get(L_HOST_INDEX, "0") or 0), p["metadata"]["name"]))
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
        cluster = _labels(pod).get(L_CLUSTER, "")
        if self.mode_for(cluster, key[0]).kind not in ("auto", "replica_failure"):
            return
        ts = now_rfc3339()
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
        cond = lambda t: {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": ts}  # noqa: E731
        pod["status"] = {
            "phase": "Running",
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"),
                           cond("ContainersReady"), cond("PodScheduled")],
            "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
            "startTime": ts, "qosClass": status.get("qosClass", "BestEffort"),
            "containerStatuses": [
                {"name": c.get("name", "ray"), "image": c.get("image", ""), "imageID": "",
                 "containerID": f"containerd://{secrets.token_hex(32)}", "ready": True, "started": True,
                 "restartCount": 0, "state": {"running": {"startedAt": ts}}, "lastState": {}}
                for c in spec.get("containers") or []
            ],
        }
        self.server.put_object(pod)

    def _mark_unschedulable(self, pod: dict, message: str) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        current = _condition(status.get("conditions") or [], "PodScheduled")
        if current and current.get("reason") == "Unschedulable" and current.get("message") == message:
            return
        ts = now_rfc3339()
        status = dict(status)
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "lastProbeTime": None,
                                 "lastTransitionTime": ts, "reason": "Unschedulable", "message": message}]
        self.server.set_status("pods", meta["namespace"], meta["name"], status)
        self.server.create_object({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"], "apiVersion": "v1", "resourceVersion": meta["resourceVersion"]},
            "reason": "FailedScheduling", "message": message, "type": "Warning",
            "source": {}, "reportingComponent": "default-scheduler",
            "reportingInstance": "default-scheduler-fakekube", "action": "Scheduling",
            "eventTime": _micro_time(), "firstTimestamp": None, "lastTimestamp": None,
        })

    # -- deletion --------------------------------------------------------------------------------

    def _cleanup(self, namespace: str, uid: str) -> None:
        for plural in ("pods", "services"):
            for obj in self.server.list_objects(plural, namespace):
                if _owned_by(obj, uid):
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
            if _owned_by(pod, uid) and not pod["metadata"].get("deletionTimestamp"):
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
        meta, spec = rc["metadata"], rc.get("spec") or {}
        old = rc.get("status") or {}
        st = copy.deepcopy(old)
        conds = st.setdefault("conditions", [])
        ns, name = meta["namespace"], meta["name"]
        if failure is not None:
            reason, message = failure
            _set_condition(conds, "ReplicaFailure", "True", reason, message)
            if meta["uid"] + reason not in self._failure_events:
                self._failure_events.add(meta["uid"] + reason)
                self._record_event(rc, "Warning", "FailedToCreateWorkerPod", f"Failed to create worker Pod: {message}")
        else:
            _remove_condition(conds, "ReplicaFailure")
            self._failure_events = {k for k in self._failure_events if not k.startswith(meta["uid"])}
        st["observedGeneration"] = meta.get("generation", 1)
        groups = [g for g in spec.get("workerGroupSpecs") or []]
        workers = [p for p in pods if _labels(p).get(L_NODE_TYPE) == "worker"]
        counts = {
            "readyWorkerReplicas": sum(1 for p in workers if _is_running_and_ready(p)),
            "availableWorkerReplicas": sum(1 for p in workers if (p.get("status") or {}).get("phase") == "Running"),
            "desiredWorkerReplicas": sum(_desired_replicas(g) for g in groups),
            "minWorkerReplicas": sum(int(g.get("minReplicas") or 0) * _num_hosts(g) for g in groups if g.get("suspend") is not True),
            "maxWorkerReplicas": min(_MAX_INT32, sum(
                int(g.get("maxReplicas") if g.get("maxReplicas") is not None else _MAX_INT32) * _num_hosts(g)
                for g in groups if g.get("suspend") is not True)),
        }
        for key, value in counts.items():  # int32 fields with omitempty
            if value:
                st[key] = value
            else:
                st.pop(key, None)
        st.update(self._desired_resources(spec))
        if failure is None and len(pods) == counts["desiredWorkerReplicas"] + 1 and _all_pods_running(pods):
            st["state"] = "ready"
            st.pop("reason", None)
        head = next((p for p in pods if _labels(p).get(L_NODE_TYPE) == "head"), None)
        if head is None:
            _set_condition(conds, "HeadPodReady", "False", "HeadPodNotFound", "Head Pod not found")
        else:
            ready = _condition((head.get("status") or {}).get("conditions") or [], "Ready")
            if ready is None:
                _set_condition(conds, "HeadPodReady", "False", "Unknown", "")
            else:
                reason = ready.get("reason") or ("HeadPodRunningAndReady" if ready.get("status") == "True" else "Unknown")
                _set_condition(conds, "HeadPodReady", ready.get("status", "False"), reason, ready.get("message", ""))
        suspending = _condition(conds, "RayClusterSuspending")
        suspended = _condition(conds, "RayClusterSuspended")
        suspend_status = ("RayClusterSuspending" if suspending and suspending.get("status") == "True" else
                          "RayClusterSuspended" if suspended and suspended.get("status") == "True" else "")
        provisioned = _condition(conds, "RayClusterProvisioned")
        if not (provisioned and provisioned.get("status") == "True") and suspend_status != "RayClusterSuspended":
            if _all_pods_running(pods):
                _set_condition(conds, "RayClusterProvisioned", "True", "AllPodRunningAndReadyFirstTime",
                               "All Ray Pods are ready for the first time")
            else:
                _set_condition(conds, "RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                               "RayCluster Pods are being provisioned for first time")
        want_suspend = spec.get("suspend") is True
        if suspend_status == "RayClusterSuspending":
            if not pods:
                _set_condition(conds, "RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                               "RayCluster has been suspended")
                _set_condition(conds, "RayClusterSuspending", "False", "RayClusterSuspending")
                _set_condition(conds, "RayClusterSuspended", "True", "RayClusterSuspended")
        elif suspend_status == "RayClusterSuspended":
            if not want_suspend:
                _set_condition(conds, "RayClusterSuspended", "False", "RayClusterSuspended")
        else:
            _set_condition(conds, "RayClusterSuspended", "False", "RayClusterSuspended")
            _set_condition(conds, "RayClusterSuspending", "True" if want_suspend else "False", "RayClusterSuspending")
        if want_suspend and not pods:
            st["state"] = "suspended"
        svc = self._head_service(rc)
        endpoints = dict(st.get("endpoints") or {})
        if svc is not None:
            for port in (svc.get("spec") or {}).get("ports") or []:
                if port.get("name") and port.get("targetPort"):
                    endpoints[port["name"]] = str(port["targetPort"])
        if endpoints:
            st["endpoints"] = endpoints
        head_info: dict[str, str] = {}
        if head is not None:
            if (head.get("status") or {}).get("podIP"):
                head_info["podIP"] = head["status"]["podIP"]
            head_info["podName"] = head["metadata"]["name"]
        if svc is not None:
            ip = svc["spec"].get("clusterIP")
            if ip == "None":
                ip = head_info.get("podIP", "")
            if ip:
                head_info["serviceIP"] = ip
            head_info["serviceName"] = svc["metadata"]["name"]
        st["head"] = head_info
        if old.get("state") != st.get("state") and st.get("state"):
            st.setdefault("stateTransitionTimes", {})[st["state"]] = now_rfc3339()
        compare = lambda s: {k: v for k, v in s.items() if k != "lastUpdateTime"}  # noqa: E731
        if compare(st) == compare(old):
            return
        st["lastUpdateTime"] = now_rfc3339()
        self.server.set_status("rayclusters", ns, name, st)

    def _head_service(self, rc: dict) -> dict | None:
        meta = rc["metadata"]
        for svc in self.server.list_objects("services", meta["namespace"],
                                            label_selector={L_CLUSTER: meta["name"], L_NODE_TYPE: "head"}):
            if _owned_by(svc, meta["uid"]):
                return svc
        return None

    @staticmethod
    def _desired_resources(spec: Mapping) -> dict[str, str]:
        """utils.CalculateDesiredResources (requests, falling back to limits), as quantity strings."""
        totals: dict[str, Decimal] = {}
        binary: dict[str, bool] = {}

        def add_pod(pod_spec: Mapping, times: int) -> None:
            for c in pod_spec.get("containers") or []:
                res = c.get("resources") or {}
                merged = dict(res.get("limits") or {})
                merged.update(res.get("requests") or {})
                for key, q in merged.items():
                    value, is_bin = parse_quantity(q)
                    totals[key] = totals.get(key, Decimal(0)) + value * times
                    binary.setdefault(key, is_bin)

        add_pod(((spec.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}, 1)
        for g in spec.get("workerGroupSpecs") or []:
            if g.get("suspend") is True:
                continue
            add_pod((g.get("template") or {}).get("spec") or {}, int(g.get("replicas") or 0) * _num_hosts(g))
        gpu = sum((v for k, v in totals.items() if k.endswith("gpu")), Decimal(0))
        return {
            "desiredCPU": format_quantity(totals.get("cpu", Decimal(0)), False),
            "desiredMemory": format_quantity(totals.get("memory", Decimal(0)), binary.get("memory", True)),
            "desiredGPU": format_quantity(gpu, False),
            "desiredTPU": format_quantity(totals.get("google.com/tpu", Decimal(0)), False),
        }

    def _record_event(self, rc: dict, type_: str, reason: str, message: str) -> None:
        meta = rc["metadata"]
        ts = now_rfc3339()
        self.server.create_object({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "RayCluster", "namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"], "apiVersion": "ray.io/v1", "resourceVersion": meta["resourceVersion"]},
            "reason": reason, "message": message, "type": type_,
            "source": {"component": "raycluster-controller"}, "reportingComponent": "raycluster-controller",
            "reportingInstance": "", "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        })


__all__ = [
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
