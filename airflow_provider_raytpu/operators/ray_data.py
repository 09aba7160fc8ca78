"""Ray Data preprocessing and batch embedding as a Ray job."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset
from airflow_provider_raytpu.operators.base import is_templated
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.tpu import plural

if TYPE_CHECKING:
    from airflow.sdk import Context


def asset_for(uri: Any) -> list[Asset]:
    """An outlet for a literal URI; a templated one (Jinja, an ``XComArg``) is only known at run time."""
    return [Asset(uri)] if isinstance(uri, str) and uri and not is_templated(uri) else []


class RayDataOperator(SubmitRayJobOperator):
    """Read parquet/JSONL, apply a batch transform with Ray Data, write parquet.

    The transform is ``"package.module:name"``: a function (stateless, run as tasks)
    or a callable class (stateful, e.g. an embedding model loaded once per actor, run
    as an actor pool of ``concurrency`` actors, each with its own resources such as one
    TPU host). Re-running the same output URI replaces it, so a retry or a rerun of
    the same logical date never duplicates rows. Returns ``rows_in``, ``rows_out``,
    ``output_uri``, ``seconds`` and ``rows_per_second``. A literal ``output_uri`` is
    declared as an Airflow asset, so downstream DAGs can be scheduled on it.

    :param cluster: the cluster reference (``create.output``), instead of ``cluster_name``.
    :param cluster_name: the RayCluster's name.
    :param input_uri: parquet/JSONL file or prefix, ``gs://`` or local.
    :param output_uri: parquet output prefix, e.g. ``gs://bucket/embeddings/{{ ds }}``.
    :param transform: ``"package.module:function_or_class"``.
    :param input_format: ``parquet`` or ``jsonl``; guessed from the URI when omitted.
    :param batch_size: rows per batch given to the transform.
    :param concurrency: actors in the pool (callable classes).
    :param num_tpus_per_actor: TPU chips per actor, e.g. a whole host's 4.
    :param resources: other Ray resources per task or actor.
    :param actor_per_tpu_host: run a callable class as one actor per TPU host of the cluster,
        each holding all of its host's chips (sets ``concurrency`` and ``num_tpus_per_actor``
        from the cluster's slice shape).
    :param transform_kwargs: keyword arguments for the transform (class constructor).
    :param batch_format: ``numpy``, ``pandas`` or ``pyarrow``.
    :param kwargs: everything :class:`SubmitRayJobOperator` takes (namespace, runtime_env, ...).
    """

    template_fields: Sequence[str] = (
        *SubmitRayJobOperator.template_fields, "input_uri", "output_uri", "transform", "transform_kwargs",
    )

    def __init__(
        self,
        *,
        input_uri: str,
        output_uri: str,
        transform: str,
        input_format: str | None = None,
        batch_size: int | None = None,
        concurrency: int | None = None,
        num_tpus_per_actor: float | None = None,
        resources: Mapping[str, float] | None = None,
        actor_per_tpu_host: bool = False,
        transform_kwargs: Mapping[str, Any] | None = None,
        batch_format: str = "numpy",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("outlets", asset_for(output_uri))
        super().__init__(entrypoint="", **kwargs)
        self.input_uri = input_uri
        self.output_uri = output_uri
        self.transform = transform
        self.input_format = input_format
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.num_tpus_per_actor = num_tpus_per_actor
        self.resources = resources
        self.actor_per_tpu_host = actor_per_tpu_host
        self.transform_kwargs = transform_kwargs
        self.batch_format = batch_format

    def prepare_entrypoint(self, context: Context) -> None:
        if self.actor_per_tpu_host:
            tpu = self.cluster_tpu(self.jobs.cluster_name, self.jobs.namespace)
            self.concurrency, self.num_tpus_per_actor = tpu.total_hosts, tpu.host_chips
            self.log.info("One actor per TPU host: %s of %s", plural(tpu.total_hosts, "actor"),
                          plural(tpu.host_chips, "chip"))
        args = ["python", "-m", "airflow_provider_raytpu.workloads.preprocess", "--input", self.input_uri,
                "--output", self.output_uri, "--transform", self.transform, "--batch-format", self.batch_format]
        optional = {"--format": self.input_format, "--batch-size": self.batch_size, "--concurrency": self.concurrency,
                    "--num-tpus-per-actor": self.num_tpus_per_actor}
        args += [str(v) for flag, value in optional.items() if value is not None for v in (flag, value)]
        if self.resources:
            args += ["--resources", json.dumps(dict(self.resources))]
        if self.transform_kwargs:
            args += ["--transform-kwargs", json.dumps(dict(self.transform_kwargs))]
        self.job_args = args
