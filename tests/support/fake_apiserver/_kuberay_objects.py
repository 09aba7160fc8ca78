"""The objects the fake KubeRay operator writes, shaped like upstream's: the labels it sets, head
and worker pods, the head Service, pod statuses a kubelet/scheduler would report, and Events."""

from __future__ import annotations

import copy
import datetime as _dt
import random
import secrets
from collections.abc import Mapping
from typing import Any

from ._resources import now_rfc3339

L_CLUSTER = "ray.io/cluster"
L_NODE_TYPE = "ray.io/node-type"
L_GROUP = "ray.io/group"
L_REPLICA_INDEX = "ray.io/worker-group-replica-index"
L_REPLICA_NAME = "ray.io/worker-group-replica-name"
L_HOST_INDEX = "ray.io/replica-host-index"
_RAND_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def rand5() -> str:
    return "".join(random.choice(_RAND_ALPHABET) for _ in range(5))


def labels_of(obj: Mapping) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def owned_by(obj: Mapping, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def _micro_time() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _owner_reference(rc: dict) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": rc["metadata"]["name"],
            "uid": rc["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def pod_manifest(rc: dict, node_type: str, group: str, template: Mapping | None,
                 extra_labels: Mapping[str, str]) -> dict:
    """A head or worker pod of ``rc`` from its group's pod template (``generateName``, upstream labels)."""
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
            "ownerReferences": [_owner_reference(rc)],
        },
        "spec": spec,
    }


def add_tpu_webhook_env(pod: dict, slice_name: str, host: int, hosts: int) -> None:
    """What GKE's TPU webhook adds to a TPU host pod at its creation (``TPU_WORKER_ID``, ``TPU_NAME``; in a
    multi-host slice ``TPU_WORKER_HOSTNAMES``), to the containers that request ``google.com/tpu``; the
    real control plane's tier runs a full stand-in of the webhook (tests/controlplane/tpuwebhook.py)."""
    for container in pod["spec"].get("containers") or []:
        if not ((container.get("resources") or {}).get("limits") or {}).get("google.com/tpu"):
            continue
        env = container.setdefault("env", [])
        env += [{"name": "TPU_WORKER_ID", "value": str(host)}, {"name": "TPU_NAME", "value": slice_name}]
        if hosts > 1:
            env.append({"name": "TPU_WORKER_HOSTNAMES",
                        "value": ",".join(f"{slice_name}-{h}" for h in range(hosts))})


def head_service_name(rc: dict) -> str:
    head = (rc.get("spec") or {}).get("headGroupSpec") or {}
    return ((head.get("headService") or {}).get("metadata") or {}).get("name") or f"{rc['metadata']['name']}-head-svc"


def head_service_manifest(rc: dict) -> dict:
    """``<name>-head-svc``: the head container's ports (``dashboard`` 8265...), headless for ClusterIP."""
    name, ns = rc["metadata"]["name"], rc["metadata"]["namespace"]
    head = (rc.get("spec") or {}).get("headGroupSpec") or {}
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
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": head_service_name(rc), "namespace": ns, "labels": dict(selector),
                     "ownerReferences": [_owner_reference(rc)]},
        "spec": spec,
    }


def running_status(pod: dict, host_ip: str, pod_ip: str) -> dict:
    """The ``status`` of a pod a kubelet runs: Running, Ready, a container status per container."""
    ts = now_rfc3339()
    spec = pod.get("spec") or {}
    cond = lambda t: {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": ts}  # noqa: E731
    return {
        "phase": "Running",
        "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"),
                       cond("ContainersReady"), cond("PodScheduled")],
        "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
        "startTime": ts, "qosClass": (pod.get("status") or {}).get("qosClass", "BestEffort"),
        "containerStatuses": [
            {"name": c.get("name", "ray"), "image": c.get("image", ""), "imageID": "",
             "containerID": f"containerd://{secrets.token_hex(32)}", "ready": True, "started": True,
             "restartCount": 0, "state": {"running": {"startedAt": ts}}, "lastState": {}}
            for c in spec.get("containers") or []
        ],
    }


def unschedulable_status(pod: dict, message: str) -> dict:
    """The ``status`` of a pod the scheduler rejected: Pending, ``PodScheduled=False/Unschedulable``."""
    status = dict(pod.get("status") or {})
    status["conditions"] = [{"type": "PodScheduled", "status": "False", "lastProbeTime": None,
                             "lastTransitionTime": now_rfc3339(), "reason": "Unschedulable", "message": message}]
    return status


def scheduling_event(pod: dict, message: str) -> dict:
    """The scheduler's ``FailedScheduling`` Event about ``pod``."""
    meta = pod["metadata"]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                           "uid": meta["uid"], "apiVersion": "v1", "resourceVersion": meta["resourceVersion"]},
        "reason": "FailedScheduling", "message": message, "type": "Warning",
        "source": {}, "reportingComponent": "default-scheduler",
        "reportingInstance": "default-scheduler-fakekube", "action": "Scheduling",
        "eventTime": _micro_time(), "firstTimestamp": None, "lastTimestamp": None,
    }


def cluster_event(rc: dict, type_: str, reason: str, message: str) -> dict:
    """An Event the raycluster controller records about ``rc``."""
    meta = rc["metadata"]
    ts = now_rfc3339()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {"kind": "RayCluster", "namespace": meta["namespace"], "name": meta["name"],
                           "uid": meta["uid"], "apiVersion": "ray.io/v1", "resourceVersion": meta["resourceVersion"]},
        "reason": reason, "message": message, "type": type_,
        "source": {"component": "raycluster-controller"}, "reportingComponent": "raycluster-controller",
        "reportingInstance": "", "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
    }
