"""A worker group's replicas as whole slices, as KubeRay reconciles them for
:class:`tests.support.fake_apiserver.kuberay.KubeRayReactor`: a slice that lost a host (or has a failed one) is deleted
whole, missing slices are created at the lowest free replica index, surplus ones go from the highest.

A mixin: the reactor owns the server.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._kuberay_modes import Mode
from ._kuberay_objects import (
    L_HOST_INDEX,
    L_REPLICA_INDEX,
    L_REPLICA_NAME,
    add_tpu_webhook_env,
    labels_of,
    pod_manifest,
    rand5,
)
from ._kuberay_status import desired_replicas, num_hosts
from .server import FakeKubeApiServer


class SliceReconciler:
    """The reactor's ``_reconcile_group``: one worker group's slices."""

    server: FakeKubeApiServer
    tpu_webhook: bool

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
                  if len(pods) < hosts
                  or any((p.get("status") or {}).get("phase") in ("Failed", "Succeeded") for p in pods)]
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
                    pod = pod_manifest(rc, "worker", gname, group.get("template"), extra)
                    if self.tpu_webhook:
                        add_tpu_webhook_env(pod, f"{gname}-{index}", host, hosts)
                    server.create_object(pod)
        elif len(replicas) > desired:
            for key in sorted(replicas, key=lambda k: index_of[k], reverse=True)[: len(replicas) - desired]:
                for pod in replicas[key]:
                    server.delete_object("pods", ns, pod["metadata"]["name"], force=True)
        return None
