"""A READY read from pods, confirmed with Ray: its node list, read through the cluster's dashboard transport.

The request is the one ``ray list nodes`` makes (``ray/util/state/api.py``:
``StateApiClient.list`` -> ``GET /api/v0/nodes`` with ``limit``, ``timeout`` and ``detail``), for
every node; the ALIVE ones are kept here. Ray's ``state=ALIVE`` filter is not used: Ray (2.60) hands
it to the GCS, which counts the nodes it leaves out as truncated (``get_all_node_info`` in
``ray/util/state/state_manager.py``; ``total = len(result) + num_truncated`` in
``ray/dashboard/state_aggregator.py``), so once a host has died the answer says 5 of 7 nodes were
kept and a complete list cannot be told from a cut one. Its answer is read by
:mod:`airflow_provider_raytpu.status.ray_nodes`. Both backends use it: on
Kubernetes through the API server's service proxy (or the connection's direct URL), locally at
the head's own address.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from airflow_provider_raytpu.dashboard.transport import HttpAnswer, HttpTransport
from airflow_provider_raytpu.status import ClusterStatus, Phase
from airflow_provider_raytpu.status.ray_nodes import (
    RayAnswerError,
    RayNode,
    confirm_with_ray,
    ray_unanswered,
    read_nodes_answer,
    tpu_hosts,
)

log = logging.getLogger(__name__)

#: Ray's own ceiling on a State API list (``RAY_MAX_LIMIT_FROM_API_SERVER``); its default is 100.
NODE_LIMIT = 10_000
#: Seconds Ray may take to gather the list (the State API's ``timeout``), and this request to answer.
NODES_TIMEOUT = 30
NODES_PATH = "/api/v0/nodes?" + urlencode({"limit": NODE_LIMIT, "timeout": NODES_TIMEOUT, "detail": "false"})


def nodes_of(answer: HttpAnswer) -> list[RayNode]:
    """The ALIVE nodes of the dashboard's answer.

    :raises RayAnswerError: it answered an error, or not a complete node list.
    """
    if answer.status == 404:
        raise RayAnswerError(
            "the dashboard does not serve Ray's State API (GET /api/v0/nodes answered 404): the head's image "
            "needs Ray's dashboard (ray[default]); for a cluster that cannot serve it, set confirm_with_ray=False")
    if not answer.ok:
        raise RayAnswerError(f"GET /api/v0/nodes answered {answer.status}: {answer.text(300).strip()}")
    try:
        return read_nodes_answer(answer.json())
    except ValueError as exc:
        raise RayAnswerError(str(exc) if isinstance(exc, RayAnswerError) else f"not JSON: {answer.text(200)}") from exc


def _needs_ray(status: ClusterStatus, pods: Iterable[Mapping[str, Any]]) -> bool:
    return status.phase is Phase.READY and bool(tpu_hosts(pods))


def confirm(status: ClusterStatus, pods: list[dict[str, Any]], transport: HttpTransport) -> ClusterStatus:
    """``status`` as Ray confirms it: a READY with TPU hosts stays READY only when Ray can reserve every slice.

    :param status: the cluster's status read from its object and ``pods``.
    :param pods: the cluster's pods.
    :param transport: the cluster's dashboard.
    """
    if not _needs_ray(status, pods):
        return status
    try:
        nodes = nodes_of(transport.request("GET", NODES_PATH, timeout=NODES_TIMEOUT + 5))
    except Exception as exc:  # any failure leaves the cluster unconfirmed, and says why in its message
        return ray_unanswered(status, _problem(exc))
    return confirm_with_ray(status, pods, nodes)


async def aconfirm(status: ClusterStatus, pods: list[dict[str, Any]], transport: HttpTransport) -> ClusterStatus:
    """:func:`confirm` without blocking the event loop."""
    if not _needs_ray(status, pods):
        return status
    try:
        nodes = nodes_of(await transport.arequest("GET", NODES_PATH, timeout=NODES_TIMEOUT + 5))
    except Exception as exc:  # as in confirm()
        return ray_unanswered(status, _problem(exc))
    return confirm_with_ray(status, pods, nodes)


def _problem(exc: Exception) -> str:
    if isinstance(exc, RayAnswerError):
        return str(exc)
    log.info("Reading Ray's node list failed: %r", exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
