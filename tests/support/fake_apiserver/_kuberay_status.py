"""RayCluster and RayService ``status`` as KubeRay v1.5-1.7 computes it (``calculateStatus``), as
pure functions of the object and its pods: counts (int32, ``omitempty``), desired resources,
``state`` ("ready"/"suspended", never reset), conditions, endpoints and head info."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from ._kuberay_objects import L_NODE_TYPE, labels_of
from ._quantity import format_quantity, parse_quantity
from ._resources import now_rfc3339

MAX_INT32 = 2147483647


def set_condition(conditions: list[dict], type_: str, status: str, reason: str, message: str = "") -> None:
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


def condition(conditions: Iterable[Mapping], type_: str) -> Mapping | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def is_running_and_ready(pod: Mapping) -> bool:
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


def num_hosts(group: Mapping) -> int:
    return max(1, int(group.get("numOfHosts") or 1))


def desired_replicas(group: Mapping) -> int:
    """utils.GetWorkerGroupDesiredReplicas, in pods (replicas x numOfHosts)."""
    if group.get("suspend") is True:
        return 0
    lo = int(group.get("minReplicas") or 0)
    hi = int(group.get("maxReplicas") if group.get("maxReplicas") is not None else MAX_INT32)
    replicas = group.get("replicas")
    if replicas is None or int(replicas) < lo:
        n = lo
    elif int(replicas) > hi:
        n = hi
    else:
        n = int(replicas)
    return n * num_hosts(group)


def desired_resources(spec: Mapping) -> dict[str, str]:
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
        add_pod((g.get("template") or {}).get("spec") or {}, int(g.get("replicas") or 0) * num_hosts(g))
    gpu = sum((v for k, v in totals.items() if k.endswith("gpu")), Decimal(0))
    return {
        "desiredCPU": format_quantity(totals.get("cpu", Decimal(0)), False),
        "desiredMemory": format_quantity(totals.get("memory", Decimal(0)), binary.get("memory", True)),
        "desiredGPU": format_quantity(gpu, False),
        "desiredTPU": format_quantity(totals.get("google.com/tpu", Decimal(0)), False),
    }


def _worker_counts(groups: list[Mapping], pods: list[dict]) -> dict[str, int]:
    workers = [p for p in pods if labels_of(p).get(L_NODE_TYPE) == "worker"]
    active = [g for g in groups if g.get("suspend") is not True]
    return {
        "readyWorkerReplicas": sum(1 for p in workers if is_running_and_ready(p)),
        "availableWorkerReplicas": sum(1 for p in workers if (p.get("status") or {}).get("phase") == "Running"),
        "desiredWorkerReplicas": sum(desired_replicas(g) for g in groups),
        "minWorkerReplicas": sum(int(g.get("minReplicas") or 0) * num_hosts(g) for g in active),
        "maxWorkerReplicas": min(MAX_INT32, sum(
            int(g.get("maxReplicas") if g.get("maxReplicas") is not None else MAX_INT32) * num_hosts(g)
            for g in active)),
    }


def _head_pod_ready(conds: list[dict], head: dict | None) -> None:
    if head is None:
        set_condition(conds, "HeadPodReady", "False", "HeadPodNotFound", "Head Pod not found")
        return
    ready = condition((head.get("status") or {}).get("conditions") or [], "Ready")
    if ready is None:
        set_condition(conds, "HeadPodReady", "False", "Unknown", "")
    else:
        reason = ready.get("reason") or ("HeadPodRunningAndReady" if ready.get("status") == "True" else "Unknown")
        set_condition(conds, "HeadPodReady", ready.get("status", "False"), reason, ready.get("message", ""))


def _provisioned_and_suspension(conds: list[dict], pods: list[dict], want_suspend: bool) -> None:
    suspending = condition(conds, "RayClusterSuspending")
    suspended = condition(conds, "RayClusterSuspended")
    suspend_status = ("RayClusterSuspending" if suspending and suspending.get("status") == "True" else
                      "RayClusterSuspended" if suspended and suspended.get("status") == "True" else "")
    provisioned = condition(conds, "RayClusterProvisioned")
    if not (provisioned and provisioned.get("status") == "True") and suspend_status != "RayClusterSuspended":
        if _all_pods_running(pods):
            set_condition(conds, "RayClusterProvisioned", "True", "AllPodRunningAndReadyFirstTime",
                          "All Ray Pods are ready for the first time")
        else:
            set_condition(conds, "RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                          "RayCluster Pods are being provisioned for first time")
    if suspend_status == "RayClusterSuspending":
        if not pods:
            set_condition(conds, "RayClusterProvisioned", "False", "RayClusterPodsProvisioning",
                          "RayCluster has been suspended")
            set_condition(conds, "RayClusterSuspending", "False", "RayClusterSuspending")
            set_condition(conds, "RayClusterSuspended", "True", "RayClusterSuspended")
    elif suspend_status == "RayClusterSuspended":
        if not want_suspend:
            set_condition(conds, "RayClusterSuspended", "False", "RayClusterSuspended")
    else:
        set_condition(conds, "RayClusterSuspended", "False", "RayClusterSuspended")
        set_condition(conds, "RayClusterSuspending", "True" if want_suspend else "False", "RayClusterSuspending")


def _endpoints_and_head(st: dict, head: dict | None, svc: dict | None) -> None:
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


def ray_cluster_status(rc: dict, pods: list[dict], failure: tuple[str, str] | None,
                       head_service: dict | None) -> dict | None:
    """The RayCluster's new ``status`` from its pods, the ``(reason, message)`` of a worker pod that
    could not be created, and its head Service; None when nothing but ``lastUpdateTime`` would change."""
    meta, spec = rc["metadata"], rc.get("spec") or {}
    old = rc.get("status") or {}
    st = copy.deepcopy(old)
    conds = st.setdefault("conditions", [])
    if failure is not None:
        set_condition(conds, "ReplicaFailure", "True", *failure)
    else:
        conds[:] = [c for c in conds if c.get("type") != "ReplicaFailure"]
    st["observedGeneration"] = meta.get("generation", 1)
    counts = _worker_counts(list(spec.get("workerGroupSpecs") or []), pods)
    for key, value in counts.items():  # int32 fields with omitempty
        if value:
            st[key] = value
        else:
            st.pop(key, None)
    st.update(desired_resources(spec))
    if failure is None and len(pods) == counts["desiredWorkerReplicas"] + 1 and _all_pods_running(pods):
        st["state"] = "ready"
        st.pop("reason", None)
    head = next((p for p in pods if labels_of(p).get(L_NODE_TYPE) == "head"), None)
    _head_pod_ready(conds, head)
    want_suspend = spec.get("suspend") is True
    _provisioned_and_suspension(conds, pods, want_suspend)
    if want_suspend and not pods:
        st["state"] = "suspended"
    _endpoints_and_head(st, head, head_service)
    if old.get("state") != st.get("state") and st.get("state"):
        st.setdefault("stateTransitionTimes", {})[st["state"]] = now_rfc3339()
    compare = lambda s: {k: v for k, v in s.items() if k != "lastUpdateTime"}  # noqa: E731
    if compare(st) == compare(old):
        return None
    st["lastUpdateTime"] = now_rfc3339()
    return st


_SERVICE_CONDITION_REASONS = {
    ("Ready", "True"): "NonZeroServeEndpoints", ("Ready", "False"): "ZeroServeEndpoints",
    ("UpgradeInProgress", "True"): "BothActivePendingClustersExist",
    ("UpgradeInProgress", "False"): "NoPendingCluster",
}


def _service_conditions(status: dict, conditions: Mapping[str, Any] | list[dict]) -> None:
    conds = status.setdefault("conditions", [])
    if isinstance(conditions, list):
        status["conditions"] = copy.deepcopy(conditions)
        return
    for type_, spec in conditions.items():
        if isinstance(spec, tuple):
            flag, reason, *rest = spec
            message = rest[0] if rest else ""
        else:
            flag, reason, message = spec, None, ""
        st = flag if isinstance(flag, str) else ("True" if flag else "False")
        set_condition(conds, type_, st, reason or _SERVICE_CONDITION_REASONS.get((type_, st), type_), message)


def ray_service_status(rs: dict, *, conditions: Mapping[str, Any] | list[dict] | None,
                       active: Mapping[str, Any] | None, pending: Mapping[str, Any] | None,
                       active_cluster: str | None, pending_cluster: str | None,
                       num_serve_endpoints: int | None) -> dict:
    """A RayService's new ``status`` (see ``KubeRayReactor.set_service_status`` for the arguments)."""
    status = copy.deepcopy(rs.get("status") or {})
    if conditions is not None:
        _service_conditions(status, conditions)
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
    ready = condition(status.get("conditions") or [], "Ready")
    if ready is not None:  # deprecated mirror of the Ready condition
        status["serviceStatus"] = "Running" if ready.get("status") == "True" else ""
        if not status["serviceStatus"]:
            status.pop("serviceStatus")
    status["observedGeneration"] = rs["metadata"].get("generation", 1)
    status["lastUpdateTime"] = now_rfc3339()
    return status
