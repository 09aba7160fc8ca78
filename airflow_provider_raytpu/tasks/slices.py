"""The slice shape a create or deploy task asks for, checked as early as it can be: literals when the DAG
is parsed, templated values before anything is created; and against what GKE offers, where the backend
is GKE's (or the local one, which emulates it)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any
from urllib.parse import parse_qs, urlsplit

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.gke_tpu import offered_shapes
from airflow_provider_raytpu.progress import TaskLog
from airflow_provider_raytpu.tasks.base import is_templated
from airflow_provider_raytpu.tpu import TpuSlice

SLICE_FIELDS = ("accelerator", "topology", "num_slices", "spot", "chips_per_host", "capacity")
#: Backends that make only the node pools GKE offers (the local one emulates GKE).
GKE_SHAPES_ONLY = ("gke", "local")


def backend_named_in_environment(conn_id: str | None) -> str | None:
    """The backend of a ``raytpu`` connection given as an ``AIRFLOW_CONN_<ID>`` variable (JSON or URI), or
    ``None``: a connection in the metadata database is not read while a DAG is parsed.

    :param conn_id: the connection id; ``None`` for ``raytpu_default``.
    """
    text = os.environ.get(f"AIRFLOW_CONN_{(conn_id or DEFAULT_CONN_ID).upper()}", "").strip()
    if text.startswith("{"):
        try:
            extra = json.loads(text).get("extra") or {}
            extra = json.loads(extra) if isinstance(extra, str) else extra
        except (ValueError, AttributeError):
            return None
        return extra.get("backend") if isinstance(extra, dict) else None
    backend = parse_qs(urlsplit(text).query).get("backend") if text else None
    return backend[0] if backend else None


def check_offered(tpu: TpuSlice, backend: str | None, log: TaskLog) -> None:
    """Refuse a shape GKE does not offer on a backend that makes only GKE's node pools; on ``kubernetes``
    (TPU nodes of your own), use it with one warning.

    :param backend: the connection's backend, or ``None`` when not known yet.
    :raises InvalidInputError: naming the shape and the shapes GKE offers.
    """
    problem = tpu.not_offered()
    if problem is None or backend is None:
        return
    if backend not in GKE_SHAPES_ONLY:
        log.warning("%s. On backend %r it is used as given: the cluster's nodes must have it", problem, backend)
        return
    raise InvalidInputError(
        "topology", tpu.topology,
        f"is not a slice shape GKE offers of {tpu.accelerator}: a node pool of it cannot be created, so its pods "
        "would stay Pending",
        f"Write one of the shapes GKE offers: {offered_shapes(tpu.accelerator)}")


def check_literal_slice(*fields: Any, raytpu_conn_id: Any = None) -> None:
    """Check a slice shape written as literals when the DAG is parsed (an import error in the UI); and, when
    the connection is an environment variable naming a GKE (or local) backend, that GKE offers it.

    Templated values (Jinja, ``XComArg``) are known only at run time, and checked then.

    :param fields: accelerator, topology, num_slices, spot, chips_per_host and capacity as given.
    :param raytpu_conn_id: the task's ``raytpu`` connection as given.
    """
    if any(is_templated(value) for value in fields):
        return
    tpu = TpuSlice.from_fields(*fields)
    if not is_templated(raytpu_conn_id):
        check_offered(tpu, backend_named_in_environment(raytpu_conn_id), logging.getLogger(__name__))
