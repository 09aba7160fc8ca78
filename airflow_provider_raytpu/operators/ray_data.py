"""Ray Data preprocessing and batch embedding as a Ray job."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.tasks.base import (
    check_import_path,
    check_literal,
    is_templated,
    map_index_of,
    mark_outlets,
)
from airflow_provider_raytpu.tasks.job_tries import run_token
from airflow_provider_raytpu.tasks.lineage import asset_for, storage_dataset, task_lineage
from airflow_provider_raytpu.values import plural
from airflow_provider_raytpu.workloads.uris import APART_FIX, output_overlap

if TYPE_CHECKING:
    from airflow.sdk import Context


def check_output_apart(input_uri: Any, output_uri: Any) -> None:
    """Refuse an output that overlaps the input (equal, or one inside the other), before anything is submitted.

    Checked when the DAG is parsed for literal URIs, and before the job for templated ones.
    """
    if not all(isinstance(uri, str) and uri.strip() for uri in (input_uri, output_uri)):
        field, value = ("input_uri", input_uri) if not (isinstance(input_uri, str) and input_uri.strip()) else (
            "output_uri", output_uri)
        raise InvalidInputError(field, value, "is empty", "Give a gs:// prefix or a path, e.g. 'gs://bucket/clean'")
    if problem := output_overlap(input_uri, output_uri):
        raise InvalidInputError("output_uri", output_uri, problem, APART_FIX)


def output_owner(context: Context, deployment: str) -> str:
    """Who writes a task's output: its deployment, DAG, task and map index (any run of the task may replace it).

    :param deployment: the Airflow deployment (:attr:`RayTpuHook.deployment`).
    """
    ti = context["ti"]
    return json.dumps({"deployment": deployment, "dag_id": ti.dag_id, "task_id": ti.task_id,
                       "map_index": map_index_of(context)}, sort_keys=True)


def output_attempt(context: Context) -> dict[str, Any]:
    """Which run and try of the task writes: its staging prefix, and who writers waiting for the output see. The
    run's token tells it from a deleted run of the same run id (whose job may still write)."""
    ti = context["ti"]
    return {"run_id": ti.run_id, "try_number": ti.try_number, "run_token": run_token(context)}


class RayDataOperator(SubmitRayJobOperator):
    """Read parquet/JSONL, apply a batch transform with Ray Data, write parquet.

    The transform is ``"package.module:name"``: a function (stateless, run as tasks)
    or a callable class (stateful, e.g. an embedding model loaded once per actor, run
    as an actor pool of ``concurrency`` actors, each with its own resources such as one
    TPU host). Re-running the same output URI replaces it, so a retry or a rerun of the
    same logical date never duplicates rows; it removes only what this task wrote there
    before (the output carries a record of its task and files), and an output prefix that
    holds anything else, or overlaps the input, is refused before anything is written.
    Runs writing one ``output_uri`` at once (a backfill) each stage apart and replace it one
    at a time, the last winning whole; a run waits for another's swap with progress lines,
    then fails (and retries). Returns ``rows_in``, ``rows_out``, ``output_uri``,
    ``output_version``, ``input_version``, ``seconds`` and ``rows_per_second``. A literal
    ``output_uri`` is declared as an Airflow asset, so downstream DAGs can be scheduled on
    it; the asset event of each outlet carries ``rows_in``, ``rows_out``, ``output_uri`` and
    ``output_version`` as extras.

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
    builds_entrypoint = True

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
        if not any(is_templated(uri) for uri in (input_uri, output_uri)):
            check_output_apart(input_uri, output_uri)
        check_literal(transform, lambda value: check_import_path(value, "transform"))
        kwargs.setdefault("outlets", asset_for(output_uri))
        super().__init__(entrypoint="", **kwargs)
        self.input_uri = input_uri
        self.output_uri = output_uri
        self.transform = transform
        self.input_format = input_format
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.num_tpus_per_actor = num_tpus_per_actor
        # Not ``self.resources``: that is BaseOperator's executor resources, which Airflow serializes as such.
        self.ray_resources = resources
        self.actor_per_tpu_host = actor_per_tpu_host
        self.transform_kwargs = transform_kwargs
        self.batch_format = batch_format

    def secret_mappings(self) -> list[Mapping[str, Any] | None]:
        return [*super().secret_mappings(), self.transform_kwargs]

    def prepare_entrypoint(self, context: Context) -> None:
        check_output_apart(self.input_uri, self.output_uri)
        check_import_path(self.transform, "transform")
        if self.actor_per_tpu_host:
            tpu = self.cluster_tpu(self.jobs.cluster_name, self.jobs.namespace)
            self.concurrency, self.num_tpus_per_actor = tpu.total_hosts, tpu.host_chips
            self.log.info("One actor per TPU host: %s of %s", plural(tpu.total_hosts, "actor"),
                          plural(tpu.host_chips, "chip"))
        args = ["python", "-m", "airflow_provider_raytpu.workloads.preprocess", "--input", self.input_uri,
                "--output", self.output_uri, "--transform", self.transform, "--batch-format", self.batch_format,
                "--owner", output_owner(context, self.hook.deployment),
                "--attempt", json.dumps(output_attempt(context))]
        optional = {"--format": self.input_format, "--batch-size": self.batch_size, "--concurrency": self.concurrency,
                    "--num-tpus-per-actor": self.num_tpus_per_actor}
        args += [str(v) for flag, value in optional.items() if value is not None for v in (flag, value)]
        if self.ray_resources:
            args += ["--resources", json.dumps(dict(self.ray_resources))]
        if self.transform_kwargs:
            args += ["--transform-kwargs", json.dumps(dict(self.transform_kwargs))]
        self.job_args = args

    def after_job(self, result: Any) -> None:
        if self.job_result:
            mark_outlets(self, {key: self.job_result.get(key)
                                for key in ("rows_in", "rows_out", "output_uri", "output_version")})

    def get_openlineage_facets_on_start(self) -> Any:
        return task_lineage([storage_dataset(self.input_uri)], [storage_dataset(self.output_uri)])

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """What it read and wrote, each versioned by the version read and committed (provider outputs)."""
        result = self.job_result
        return task_lineage([storage_dataset(self.input_uri, version=result.get("input_version"))],
                            [storage_dataset(result.get("output_uri") or self.output_uri, rows=result.get("rows_out"),
                                             version=result.get("output_version"))])
