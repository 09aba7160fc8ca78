"""The node Leases in ``kube-node-lease`` that the virtual kubelet (kubelet.py) renews every 10 s, so the
node lifecycle controller keeps its nodes Ready.

A mixin: the kubelet owns the control plane, the stop event and the nodes it serves.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.controlplane.controlplane import ControlPlane


class NodeLeases:
    """The virtual kubelet's ``renew_lease`` and its lease loop."""

    cp: ControlPlane
    _stop: threading.Event
    _nodes_lock: threading.Lock
    _nodes: dict[str, dict[str, Any]]

    LEASE_SECONDS = 40
    RENEW_EVERY = 10.0

    def renew_lease(self, node_name: str, core=None) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = core.api_client if core is not None else getattr(self, "_lease_api", None)
        if api is None:
            api = self._lease_api = self.cp.api_client()
        coord = client.CoordinationV1Api(api)
        now = dt.datetime.now(dt.UTC)
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=node_name, namespace="kube-node-lease"),
            spec=client.V1LeaseSpec(holder_identity=node_name, lease_duration_seconds=self.LEASE_SECONDS,
                                    renew_time=now))
        try:
            coord.patch_namespaced_lease(node_name, "kube-node-lease",
                                         {"spec": {"holderIdentity": node_name,
                                                   "leaseDurationSeconds": self.LEASE_SECONDS,
                                                   "renewTime": now.isoformat().replace("+00:00", "Z")}},
                                         _content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                coord.create_namespaced_lease("kube-node-lease", body)
            except ApiException as e2:
                if e2.status != 409:
                    raise

    def _lease_loop(self) -> None:
        self._lease_api = self.cp.api_client()
        while not self._stop.wait(self.RENEW_EVERY):
            with self._nodes_lock:
                names = list(self._nodes)
            for n in names:
                self.renew_lease(n)
