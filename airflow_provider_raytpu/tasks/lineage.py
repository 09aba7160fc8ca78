"""What a task read and wrote: as Airflow assets (a task's outlets, :func:`asset_for`) and as OpenLineage
datasets, for the OpenLineage provider's listener.

Airflow's OpenLineage provider asks each operator for ``get_openlineage_facets_on_start()`` and
``get_openlineage_facets_on_complete(task_instance)``; the tasks answer with the helpers here.
Datasets are named as OpenLineage's naming spec gives them (``spec/Naming.md``): ``gs://bucket``
and the object path (``extract_ds_name_from_gcs_path`` of the Google provider does the same for its
GCS operators), ``file`` and the absolute path for local storage. A RayService is
``rayservice://<namespace>`` and its name, its served version the dataset's version. The OpenLineage
classes are imported only when the listener asks: without the provider nothing here runs.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.sdk import Asset

#: Schemes whose authority is a bucket (OpenLineage names the dataset by its object path in it).
BUCKET_SCHEMES = frozenset({"gs", "gcs", "s3", "s3a", "abfs", "abfss", "wasbs"})


def dataset_id(uri: str) -> tuple[str, str]:
    """OpenLineage's namespace and name of a storage URI or local path.

    ``gs://bucket/a/b/`` -> ``("gs://bucket", "a/b")``; ``/data/x`` or ``file:///data/x`` -> ``("file", "/data/x")``.
    """
    parts = urlsplit(uri)
    if parts.scheme in BUCKET_SCHEMES:
        return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/") or "/"
    if parts.scheme in ("", "file"):
        path = parts.path if parts.scheme else str(Path(uri).absolute())
        return "file", posixpath.normpath(path)
    return f"{parts.scheme}://{parts.netloc}", parts.path.rstrip("/") or "/"


def is_storage_uri(value: str) -> bool:
    """Whether a version names a place in storage (a checkpoint), not only a label such as ``v2``."""
    return "://" in value or value.startswith("/")


def checkpoint_dataset(checkpoint: str) -> tuple[str, str | None]:
    """The dataset a checkpoint belongs to, and its version there.

    A checkpoint the training task wrote, ``<checkpoint_uri>/<run>/orbax/<step>``, is a version of the
    ``checkpoint_uri`` the task declared (``("gs://b/ckpt", "run-1/orbax/30")``), so the training task's
    START and COMPLETE events and a task reading the checkpoint name one dataset. Another checkpoint is a
    version of its directory (``gs://b/models/30`` -> ``("gs://b/models", "30")``), or a dataset of its own.

    :param checkpoint: the URI of one checkpoint.
    """
    directory, _, step = checkpoint.rstrip("/").rpartition("/")
    if not (step.isdigit() and directory.rstrip("/")):
        return checkpoint.rstrip("/"), None
    run_directory, _, orbax = directory.rpartition("/")
    root, _, run = run_directory.rpartition("/")
    if orbax == "orbax" and run and root.rstrip("/"):
        return root, f"{run}/orbax/{step}"
    return directory, step


def storage_dataset(uri: str, *, rows: int | None = None, version: str | None = None) -> Dataset:
    """A dataset in storage, with what is known of it.

    :param rows: rows written (an output's ``outputStatistics``).
    :param version: the dataset's version (a checkpoint's step).
    """
    from airflow.providers.common.compat.openlineage.facet import (
        Dataset,
        OutputDataset,
        OutputStatisticsOutputDatasetFacet,
    )

    namespace, name = dataset_id(uri)
    facets: dict[str, Any] = {}
    if version is not None:
        facets["version"] = version_facet(version)
    if rows is None:
        return Dataset(namespace=namespace, name=name, facets=facets)
    return OutputDataset(namespace=namespace, name=name, facets=facets,
                         outputFacets={"outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=rows)})


def service_dataset(namespace: str, name: str, version: str | None) -> Dataset:
    """A RayService as a dataset: what it serves is its version."""
    from airflow.providers.common.compat.openlineage.facet import Dataset

    return Dataset(namespace=f"rayservice://{namespace}", name=name,
                   facets={"version": version_facet(version)} if version else {})


def version_facet(version: str) -> Any:
    from openlineage.client.facet_v2 import dataset_version_dataset

    return dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=version)


def task_lineage(inputs: Iterable[Dataset], outputs: Iterable[Dataset]) -> OperatorLineage[Dataset, Any]:
    """The task's lineage: what it read, what it wrote."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    return OperatorLineage(inputs=list(inputs), outputs=list(outputs))


def asset_for(uri: Any) -> list[Asset]:
    """An Airflow outlet for a literal URI; a templated one (Jinja, an ``XComArg``) is only known at run time."""
    from airflow.sdk import Asset

    from airflow_provider_raytpu.tasks.base import is_templated

    return [Asset(uri)] if isinstance(uri, str) and uri and not is_templated(uri) else []
