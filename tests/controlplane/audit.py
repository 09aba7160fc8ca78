"""What the provider asked of the API server, from its audit log (``components.AUDIT_POLICY``): each request
the provider's clients made (they name themselves in ``User-Agent``) as who, which verb on which resource,
where, and the answer's code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airflow_provider_raytpu.backends.kuberay.shared_client import USER_AGENT

if TYPE_CHECKING:
    from tests.controlplane.controlplane import ControlPlane


@dataclass(frozen=True)
class Request:
    """One request, as the audit log records it.

    :param user: the identity's user name (``system:serviceaccount:<ns>:<name>`` for a ServiceAccount).
    :param verb: RBAC's verb (``get``, ``list``, ``watch``, ``create``, ``update``, ``patch``, ``delete``).
    :param group: the API group (``""`` for the core group).
    :param resource: the resource, with its subresource after a ``/`` (``services/proxy``).
    :param namespace: ``""`` for a cluster-scoped request.
    :param code: the answer's HTTP status (through ``services/proxy``, the proxied server's).
    :param refused: RBAC refused it (the API server's own 403, not a proxied one).
    """

    user: str
    verb: str
    group: str
    resource: str
    namespace: str
    code: int
    refused: bool

    @property
    def permission(self) -> tuple[str, str, str]:
        """(group, resource, verb), as an RBAC rule grants it."""
        return self.group, self.resource, self.verb


def provider_requests(cp: ControlPlane) -> list[Request]:
    """Every request the provider made so far in this control plane's life, one per request (the audit
    log's last stage of each: a watch is logged when its answer starts and again when it ends)."""
    last: dict[str, dict] = {}
    with cp.audit_log_path.open() as lines:
        for line in lines:
            event = json.loads(line)
            if (event.get("userAgent") or "").startswith(USER_AGENT) and "objectRef" in event:
                last[event["auditID"]] = event
    requests = []
    for event in last.values():
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        requests.append(Request(user=event["user"]["username"], verb=event["verb"], group=ref.get("apiGroup", ""),
                                resource=resource, namespace=ref.get("namespace", ""),
                                code=event.get("responseStatus", {}).get("code", 0),
                                refused=event.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"))
    return requests
