"""A DAG run's small files next to its checkpoints: the run report it writes, the training attempts' records it reads.

``gs://`` goes through the Google provider's GCS hook (the ``raytpu`` connection's ``gcp_conn_id``); anything
else is an absolute local directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.errors import FatalError, InvalidInputError

GCS_PREFIX = "gs://"
#: The report's files: name -> MIME type.
MIME_TYPES = {".json": "application/json", ".png": "image/png"}


def check_report_uri(value: str, field: str = "report_uri") -> str:
    """``value`` when it is ``gs://bucket[/prefix]`` or an absolute local directory; else an error naming the field."""
    if isinstance(value, str) and ((value.startswith(GCS_PREFIX) and value[len(GCS_PREFIX):].strip("/"))
                                   or os.path.isabs(value)):
        return value.rstrip("/")
    raise InvalidInputError(field, value, "is not a place for reports",
                            "Give gs://bucket/prefix (e.g. next to the checkpoints) or an absolute local directory")


def _gcs(directory: str, gcp_conn_id: str) -> tuple[Any, str, str]:
    """The Google provider's GCS hook, and the bucket and object prefix (no trailing ``/``) of ``directory``."""
    try:
        from airflow.providers.google.cloud.hooks.gcs import GCSHook
    except ImportError as exc:
        raise FatalError(f"reaching {directory} needs the Google provider: "
                         "pip install 'airflow-provider-raytpu[gke]'") from exc
    bucket, _, prefix = directory[len(GCS_PREFIX):].partition("/")
    return GCSHook(gcp_conn_id=gcp_conn_id), bucket, prefix.strip("/")


def write_report_files(directory: str, files: Mapping[str, bytes], gcp_conn_id: str) -> list[str]:
    """Write each file into ``directory`` (replacing an earlier try's) and return their URIs.

    :param directory: ``gs://bucket/prefix`` or an absolute local directory, made if missing.
    :param files: file name -> contents.
    :param gcp_conn_id: the Google Cloud connection for ``gs://`` (anonymous for a GCS emulator).
    """
    if not directory.startswith(GCS_PREFIX):
        Path(directory).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            Path(directory, name).write_bytes(data)
        return [str(Path(directory, name)) for name in files]
    hook, bucket, prefix = _gcs(directory, gcp_conn_id)
    for name, data in files.items():
        hook.upload(bucket, f"{prefix}/{name}".lstrip("/"), data=data, mime_type=MIME_TYPES.get(Path(name).suffix))
    return [f"{directory}/{name}" for name in files]


def read_files(directory: str, name_prefix: str, gcp_conn_id: str) -> dict[str, bytes]:
    """The files directly in ``directory`` whose names start with ``name_prefix``, by name (none: empty).

    :param directory: ``gs://bucket/prefix``, or a local directory (``file://`` or a path).
    :param name_prefix: e.g. ``attempt-``.
    :param gcp_conn_id: the Google Cloud connection for ``gs://``.
    """
    if not directory.startswith(GCS_PREFIX):
        folder = Path(directory.removeprefix("file://"))
        return {p.name: p.read_bytes() for p in sorted(folder.glob(f"{name_prefix}*")) if p.is_file()}
    hook, bucket, prefix = _gcs(directory, gcp_conn_id)
    start = f"{prefix}/" if prefix else ""
    names = hook.list(bucket, prefix=f"{start}{name_prefix}")
    return {name[len(start):]: hook.download(bucket, name) for name in names if "/" not in name[len(start):]}
