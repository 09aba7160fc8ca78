"""Ray Serve's REST API on a cluster's dashboard, through the backend's transport: what Serve runs now."""

from __future__ import annotations

import logging
from typing import Any

from airflow_provider_raytpu.dashboard.transport import HttpAnswer, HttpTransport

log = logging.getLogger(__name__)

SERVE_APPLICATIONS_ENDPOINT = "/api/serve/applications/"
READ_TIMEOUT_SECONDS = 10.0
_ACCEPT_JSON = {"Accept": "application/json"}


def _details(answer: HttpAnswer, where: str) -> dict[str, Any] | None:
    if not answer.ok:
        log.warning("Cannot read Serve applications of %s: it answered %s: %s", where, answer.status,
                    answer.text(200))
        return None
    return answer.json() or {}


def serve_details(dashboard: HttpTransport, where: str) -> dict[str, Any] | None:
    """Serve's ``GET /api/serve/applications/`` (``applications``, ``proxies``, ...); ``None`` when it does not answer.

    :param dashboard: the cluster's dashboard.
    :param where: the cluster, for the warning (e.g. ``RayCluster ml/chat-x7k2p``).
    """
    try:
        return _details(dashboard.request("GET", SERVE_APPLICATIONS_ENDPOINT, headers=_ACCEPT_JSON,
                                          timeout=READ_TIMEOUT_SECONDS), where)
    except Exception as exc:  # the dashboard restarts, the proxy has no endpoints yet, RBAC
        log.warning("Cannot read Serve applications of %s: %s", where, exc)
        return None


async def aserve_details(dashboard: HttpTransport, where: str) -> dict[str, Any] | None:
    """:func:`serve_details` without blocking the event loop."""
    try:
        return _details(await dashboard.arequest("GET", SERVE_APPLICATIONS_ENDPOINT, headers=_ACCEPT_JSON,
                                                 timeout=READ_TIMEOUT_SECONDS), where)
    except Exception as exc:  # the dashboard restarts, the proxy has no endpoints yet, RBAC
        log.warning("Cannot read Serve applications of %s: %s", where, exc)
        return None
