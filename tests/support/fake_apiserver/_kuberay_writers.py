"""What :class:`tests.support.fake_apiserver.kuberay.KubeRayReactor` writes into ``.status``: a RayCluster's status (and
its ``FailedToCreateWorkerPod`` Event) after each reconcile, and on a test's request realistic RayService
and RayJob statuses (no controller behind them).

A mixin: the reactor owns the server and the failure Events already written.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ._kuberay_objects import L_CLUSTER, L_NODE_TYPE, cluster_event, owned_by
from ._kuberay_status import ray_cluster_status, ray_service_status
from .server import ApiError, FakeKubeApiServer, resolve_resource


class StatusWriters:
    """The reactor's status writes: ``_write_status`` after a reconcile, ``set_service_status`` and
    ``set_job_status`` for tests."""

    server: FakeKubeApiServer
    _failure_events: set[str]

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
