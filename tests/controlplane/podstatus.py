"""The pod statuses the virtual kubelet (kubelet.py) reports, as a kubelet writes them: Running + Ready
(conditions, container and init-container statuses, a pod IP from the node's podCIDR), and Failed with
reason ``NodeShutdown`` when the node goes.

A mixin: the kubelet owns the nodes' lock that guards their next free pod IP.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
import threading
from typing import Any


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


class PodStatuses:
    """The virtual kubelet's ``_is_running_ready``, ``_allocate_ip``, ``_running_status`` and ``_failed_status``."""

    _nodes_lock: threading.Lock

    @staticmethod
    def _is_running_ready(pod) -> bool:
        st = pod.status
        if st.phase != "Running" or not st.pod_ip:
            return False
        ready = {c.type: c.status for c in (st.conditions or [])}
        if ready.get("Ready") != "True":
            return False
        names = {c.name for c in pod.spec.containers}
        statuses = {c.name: c.ready for c in (st.container_statuses or [])}
        return all(statuses.get(n) for n in names)

    def _allocate_ip(self, info: dict[str, Any]) -> str:
        with self._nodes_lock:
            n = info["next"]
            info["next"] = n + 1
        net = ipaddress.ip_network(info["cidr"], strict=False)
        return str(net.network_address + (n % (net.num_addresses - 2) or 1))

    def _running_status(self, pod, info: dict[str, Any], pod_ip: str | None = None, restarts: int = 0,
                        exit_code: int | None = None) -> dict[str, Any]:
        """Running + Ready; with ``exit_code``, Running but not ready: the container exited with it and was
        started again (its ``restarts``-th time), and its readiness probe has not passed since."""
        now = _now().isoformat().replace("+00:00", "Z")
        pod_ip = pod_ip or pod.status.pod_ip or self._allocate_ip(info)
        cond = lambda t: {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}  # noqa: E731

        def cid() -> str:
            return "containerd://" + secrets.token_hex(32)

        init_statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "containerID": cid(), "ready": True, "restartCount": 0, "started": False,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now,
                                     "containerID": None}},
        } for c in (pod.spec.init_containers or [])]
        for s in init_statuses:
            s["state"]["terminated"]["containerID"] = s["containerID"]
        ready = exit_code is None
        statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "containerID": cid(), "ready": ready, "started": True, "restartCount": restarts,
            "state": {"running": {"startedAt": now}},
        } for c in pod.spec.containers]
        if not ready:
            statuses[0]["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error", "finishedAt": now}}
        readiness = cond if ready else lambda t: {**cond(t), "status": "False", "reason": "ContainersNotReady"}
        status: dict[str, Any] = {
            "phase": "Running",
            "hostIP": info["ip"], "hostIPs": [{"ip": info["ip"]}],
            "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
            "startTime": now,
            "qosClass": pod.status.qos_class,
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), readiness("Ready"),
                           readiness("ContainersReady")],
            "containerStatuses": statuses,
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        return {"status": {k: v for k, v in status.items() if v is not None}}

    @staticmethod
    def _failed_status(pod) -> dict[str, Any]:
        now = _now().isoformat().replace("+00:00", "Z")
        statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "ready": False, "started": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}},
        } for c in pod.spec.containers]
        notready = lambda t: {"type": t, "status": "False", "lastTransitionTime": now,  # noqa: E731
                              "reason": "PodFailed"}
        return {"status": {
            "phase": "Failed", "reason": "NodeShutdown",
            "message": "Pod was terminated in response to imminent node shutdown.",
            "conditions": [notready("Ready"), notready("ContainersReady"),
                           {"type": "DisruptionTarget", "status": "True", "lastTransitionTime": now,
                            "reason": "TerminationByKubelet",
                            "message": "Pod was terminated in response to imminent node shutdown."}],
            "containerStatuses": statuses,
        }}
