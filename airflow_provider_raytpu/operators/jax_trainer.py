"""Fault-tolerant JaxTrainer training on whole TPU slices, as a Ray job that resumes on retry."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.hooks.run_files import read_files
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.status.run_report import TRAINING_ATTEMPTS_XCOM_KEY
from airflow_provider_raytpu.tasks.base import (
    check_import_path,
    check_literal,
    check_not_empty,
    is_templated,
    mark_outlets,
)
from airflow_provider_raytpu.tasks.job_tries import run_token
from airflow_provider_raytpu.tasks.lineage import asset_for, checkpoint_dataset, storage_dataset, task_lineage
from airflow_provider_raytpu.tasks.links import (
    CheckpointsLink,
    ProfileLink,
    RayJobLink,
    push_link,
    storage_console_url,
)
from airflow_provider_raytpu.tasks.slices import SLICE_FIELDS, SliceFields, elastic_range, warn_spot
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.values import duration_seconds
from airflow_provider_raytpu.workloads.progress import ATTEMPT_PREFIX, ATTEMPTS_SUBDIR, training_progress
from airflow_provider_raytpu.workloads.run_record import ON_CONFIG_CHANGE
from airflow_provider_raytpu.workloads.steps import profile_window

if TYPE_CHECKING:
    from airflow.sdk import Context


def describe_step_times(step_time: Mapping[str, Any] | None) -> str:
    """The step-time line of a training task's log: ``median 12.1 ms, p95 20.4 ms over 30 steps on 2 workers ...``.

    :param step_time: the job result's ``step_time``, or ``None``.
    """
    if not step_time or step_time.get("median_s") is None:
        return ("not recorded: time the train loop's steps with "
                "airflow_provider_raytpu.workloads.steps.StepClock to see them here")
    waits, first, workers = step_time.get("data_wait_share"), step_time.get("first_step_s"), step_time["workers"]
    return (
        f"median {_duration(step_time['median_s'])}, p95 {_duration(step_time['p95_s'])} over "
        f"{step_time['steps']} steps on {workers} {'worker' if workers == 1 else 'workers'}"
        + (f", waiting for data {waits:.0%} of step time" if waits is not None else "")
        + (f"; first step {_duration(first)} (with compilation)" if first is not None else "")
    )


def describe_attempts(progress: Mapping[str, Any]) -> str:
    """The restarts line of a training task's log: ``1 restart lost 7 steps (reached 17, resumed from 10)``."""
    if not progress["restarts"]:
        return f"trained in one attempt, from step {progress['started_at_step']}"
    each = "; ".join(f"reached {r['reached']}, resumed from {r['resumed_from']}" for r in progress["lost"])
    restarts = f"{progress['restarts']} restart{'s' if progress['restarts'] > 1 else ''}"
    return f"{restarts} lost {progress['steps_lost']} steps ({each})"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def run_name_of(context: Context, resume_on_clear: bool = False) -> str:
    """Ray Train's run name: the same for every retry of a task in a DAG run, so a retry resumes.

    A Clear starts a new cycle of tries, so a new run from step 0: the name includes the
    ``max_tries`` Airflow records on the task instance, which a Clear changes and a retry does
    not (:mod:`~airflow_provider_raytpu.tasks.job_tries`). With ``resume_on_clear`` every
    cycle has the same name, so a Clear resumes the run the cleared task trained. A DAG run
    deleted and created again with the same run id is another run (its :func:`run_token`): it
    never resumes the checkpoints of the run it replaced.
    """
    ti = context["ti"]
    identity = (f"{ti.dag_id}|{ti.run_id}|{ti.task_id}|{ti.map_index}|{run_token(context)}"
                + ("" if resume_on_clear else f"|{ti.max_tries}"))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{ti.dag_id}.{ti.task_id}")[:100].strip("-.")
    return f"{readable}-{digest}"


class JaxTrainerOperator(SubmitRayJobOperator):
    """Train with Ray Train's JaxTrainer on the cluster's TPU slices; checkpoints go to storage with orbax.

    Workers = hosts per slice x slices, placed by Ray on whole slices from the
    cluster's recorded slice shape. Each slice field given states what the cluster must be: one
    the cluster disagrees with fails the task before the job, naming the field. The run
    name is the same for every retry of the task in a DAG run, so an Airflow retry after
    a failed or lost job resumes from the latest checkpoint in ``checkpoint_uri`` instead
    of step 0, and a failed worker (a preempted host) is restarted up to ``max_failures``
    times within the job. A user's Clear starts a new run from step 0 (the run name
    includes the cycle), unless ``resume_on_clear``. A DAG run deleted and created again
    with the same run id is another run: it never resumes the old run's checkpoints. A
    resume under a changed training config is refused unless ``on_config_change`` says
    otherwise. Returns ``metrics``,
    ``checkpoint_uri`` (the latest checkpoint), ``steps``, ``resumed_from_step``,
    ``run_name``, ``step_time`` (median and p95 step time and the data-wait share, from
    the loop's :class:`~airflow_provider_raytpu.workloads.steps.StepClock`) and
    ``profile_uri``. The task log ends with the step times; the task page links to the
    run's checkpoints and profile in the Cloud console (for ``gs://`` storage outside an
    emulator). The asset event of each outlet (a literal ``checkpoint_uri`` is one) carries
    ``checkpoint_uri``, ``checkpoint_step`` and ``run_name`` as extras. What restarts cost (a
    preempted slice, a failed host, an Airflow retry) goes to its own XCom,
    ``training_attempts``, and onto the outlets' asset events too: ``attempts``,
    ``restarts``, ``steps_lost`` (the steps each attempt reached beyond the checkpoint the next
    resumed from) and ``started_at_step``, from the records the loop's ``StepClock`` keeps in
    ``<checkpoint_uri>/<run name>/attempts`` (read with the connection's ``gcp_conn_id``).

    :param cluster: the cluster reference (``create.output``), instead of ``cluster_name``.
    :param cluster_name: the RayCluster's name.
    :param train_loop: ``"package.module:train_loop_per_worker"``; ship the package in
        ``runtime_env={"py_modules": [...]}`` unless the image has it.
    :param checkpoint_uri: storage root for runs, ``gs://bucket/prefix`` or local.
    :param config: the loop's config (JSON-able; templated).
    :param datasets: dataset name -> parquet/JSONL URI, e.g. the preprocessing output from XCom.
    :param max_failures: worker-group restarts allowed inside the job.
    :param batch_size: rows per worker per step, checked against the datasets before training.
    :param ragged_policy: the final ragged batch: ``drop``, ``pad`` or ``raise`` (fails before training).
    :param checkpoints_to_keep: how many recent checkpoints Ray Train keeps.
    :param profile_steps: ``(first, end)``: every worker records a JAX profiler trace of the steps
        ``first <= step < end`` into ``<checkpoint_uri>/<run name>/profile`` (TensorBoard's
        ``plugins/profile`` layout); the loop must time its steps with ``StepClock``.
    :param accelerator: optional; must agree with the cluster's slice.
    :param topology: optional; must agree with the cluster's slice.
    :param num_slices: optional; must agree with the cluster's slice count.
    :param chips_per_host: optional; must agree with the cluster's chips per host.
    :param capacity: optional; must agree with the capacity the cluster's slices are on (``"spot"``, ...).
    :param spot: deprecated: write ``capacity="spot"``.
    :param elastic_slices: ``(min, max)``: train elastically, on as many whole slices as are ready, at least
        ``min`` and at most ``max`` of the cluster's (Ray Train's elastic training). When a slice is lost the
        run goes on, from its newest checkpoint, on the slices left (if ``min`` allows); once the slice is back
        it grows again. The global batch is per-worker batch x workers, so it changes with the slices. A range
        given as ``num_slices`` (the older spelling) still works, and warns.
    :param resize_interval: with ``elastic_slices``, how long between Ray Train's checks for more ready slices
        (its ``elastic_resize_monitor_interval_s``; a ``timedelta`` or seconds).
    :param resume_on_clear: after a user's Clear, resume the run the cleared task trained
        (its newest checkpoint) instead of starting a new run from step 0.
    :param on_config_change: what a retry or resumed Clear does when the run was started with another
        training config (``train_loop``, ``config``, ``datasets``, ``batch_size``, ``ragged_policy``):
        ``"fail"`` (the default: fails without retries, naming the keys that changed), ``"start_fresh"``
        (a new run from step 0; the old checkpoints are kept) or ``"resume"`` (resume anyway).
    :param kwargs: everything :class:`SubmitRayJobOperator` takes (namespace, runtime_env, ...).
    """

    template_fields: Sequence[str] = (
        *SubmitRayJobOperator.template_fields, "train_loop", "checkpoint_uri", "config", "datasets", *SLICE_FIELDS,
        "elastic_slices",
    )
    template_fields_renderers = {**SubmitRayJobOperator.template_fields_renderers, "config": "json",
                                 "datasets": "json"}
    operator_extra_links = (RayJobLink(), CheckpointsLink(), ProfileLink())
    builds_entrypoint = True

    def __init__(
        self,
        *,
        train_loop: str,
        checkpoint_uri: str,
        config: Mapping[str, Any] | None = None,
        datasets: Mapping[str, str] | None = None,
        max_failures: int = 3,
        batch_size: int | None = None,
        ragged_policy: str | None = None,
        checkpoints_to_keep: int = 3,
        profile_steps: tuple[int, int] | Sequence[int] | None = None,
        accelerator: str | None = None,
        topology: str | None = None,
        num_slices: int | str | None = None,
        chips_per_host: int | str | None = None,
        capacity: str | None = None,
        spot: bool | str = False,
        elastic_slices: tuple[int, int] | Sequence[int] | str | None = None,
        resume_on_clear: bool = False,
        resize_interval: timedelta | float = 60.0,
        on_config_change: str = "fail",
        **kwargs: Any,
    ) -> None:
        if on_config_change not in ON_CONFIG_CHANGE:
            raise InvalidInputError("on_config_change", on_config_change, f"is not one of {list(ON_CONFIG_CHANGE)}",
                                    "Write 'fail' (the default), 'start_fresh' or 'resume'")
        check_literal(checkpoint_uri, lambda value: check_not_empty(value, "checkpoint_uri", "'gs://bucket/checkpoints'"))
        kwargs.setdefault("outlets", asset_for(checkpoint_uri))
        if (batch_size is None) != (ragged_policy is None):
            raise InvalidInputError(
                "batch_size/ragged_policy", (batch_size, ragged_policy), "are given one without the other",
                "Give both (the driver checks the datasets split into whole batches before training) or neither",
            )
        if not is_templated((num_slices, elastic_slices)):
            num_slices, elastic_slices = elastic_range(num_slices, elastic_slices)
        warn_spot(spot)
        SliceFields(accelerator=accelerator, topology=topology, num_slices=num_slices, chips_per_host=chips_per_host,
                    capacity=capacity, spot=spot).check_literal_parts()
        profile_window(profile_steps)
        check_literal(train_loop, lambda value: check_import_path(value, "train_loop"))
        super().__init__(entrypoint="", **kwargs)
        self.train_loop = train_loop
        self.checkpoint_uri = checkpoint_uri
        self.config = config
        self.datasets = datasets
        self.max_failures = max_failures
        self.batch_size = batch_size
        self.ragged_policy = ragged_policy
        self.checkpoints_to_keep = checkpoints_to_keep
        self.profile_steps = profile_steps
        self.accelerator = accelerator
        self.topology = topology
        self.num_slices = num_slices
        self.chips_per_host = chips_per_host
        self.capacity = capacity
        self.spot = spot
        self.elastic_slices = elastic_slices
        self.resume_on_clear = resume_on_clear
        self.resize_interval = duration_seconds(resize_interval, "resize_interval", example="60 (Ray Train's default)",
                                                allow_zero=True)
        self.on_config_change = on_config_change

    def training_slices(self) -> tuple[TpuSlice, tuple[int, int] | None]:
        """The cluster's slice, once what this task states agrees with it, and the elastic ``(min, max)`` within it
        (``None``: train on all of its slices)."""
        name, namespace = self.jobs.cluster_name, self.jobs.namespace
        num_slices, slices = elastic_range(self.num_slices, self.elastic_slices)
        stated = dataclasses.replace(SliceFields.of(self), num_slices=num_slices)
        tpu = stated.against(self.recorded_tpu(name, namespace), f"RayCluster {namespace}/{name}")
        if slices and slices[1] > tpu.num_slices:
            raise InvalidInputError(
                "elastic_slices", slices, f"asks for up to {slices[1]} slices, but RayCluster {namespace}/{name} has "
                f"{tpu.num_slices}", f"Write elastic_slices=({min(slices[0], tpu.num_slices)}, {tpu.num_slices})")
        return tpu, slices

    def secret_mappings(self) -> list[Mapping[str, Any] | None]:
        return [*super().secret_mappings(), self.config]

    def prepare_entrypoint(self, context: Context) -> None:
        check_import_path(self.train_loop, "train_loop")
        check_not_empty(self.checkpoint_uri, "checkpoint_uri", "'gs://bucket/checkpoints'")
        window = profile_window(self.profile_steps)
        tpu, slices = self.training_slices()
        run_name = run_name_of(context, self.resume_on_clear)
        run_uri = f"{self.checkpoint_uri.rstrip('/')}/{run_name}"
        elastic = f", elastically on {slices[0]} to {slices[1]} of its slices" if slices else ""
        self.log.info("Training on %s%s as Ray Train run %s; its checkpoints go to %s", tpu.describe(), elastic,
                      run_name, run_uri)
        push_link(context, CheckpointsLink, storage_console_url(run_uri))
        push_link(context, ProfileLink, storage_console_url(f"{run_uri}/profile") if window else None)
        args = ["python", "-m", "airflow_provider_raytpu.workloads.train", "--train-loop", self.train_loop,
                "--tpu", json.dumps(tpu.to_dict()), "--run-name", run_name,
                "--checkpoint-uri", self.checkpoint_uri, "--config", json.dumps(dict(self.config or {})),
                "--datasets", json.dumps(dict(self.datasets or {})), "--max-failures", str(self.max_failures),
                "--checkpoints-to-keep", str(self.checkpoints_to_keep), "--on-config-change", self.on_config_change]
        if self.batch_size is not None:
            args += ["--batch-size", str(self.batch_size)]
        if self.ragged_policy:
            args += ["--ragged-policy", self.ragged_policy]
        if window:
            args += ["--profile-steps", str(window[0]), str(window[1])]
        if slices:
            args += ["--slices", str(slices[0]), str(slices[1]), "--resize-interval", str(self.resize_interval)]
        self.job_args = args

    def after_job(self, result: Any) -> None:
        result = self.job_result
        if self.profile_steps is not None:
            if result.get("profile_uri"):
                self.log.info("Profile of steps %s: %s (open with tensorboard --logdir %s)", tuple(self.profile_steps),
                              result["profile_uri"], result["profile_uri"])
            else:
                self.log.warning("No profile was written for steps %s: the run did not reach them, or the train "
                                 "loop does not time its steps with StepClock", tuple(self.profile_steps))
        self.log.info("Step time: %s", describe_step_times(result.get("step_time")))
        mark_outlets(self, {"checkpoint_uri": result.get("checkpoint_uri"), "checkpoint_step": result.get("steps"),
                            "run_name": result.get("run_name")})
        if result.get("run_name"):
            self.record_attempts(str(result["run_name"]))

    def input_datasets(self) -> list[Any]:
        """The OpenLineage datasets of the ``datasets`` it reads."""
        return [storage_dataset(uri) for uri in (self.datasets or {}).values()]

    def get_openlineage_facets_on_start(self) -> Any:
        return task_lineage(self.input_datasets(), [storage_dataset(self.checkpoint_uri)])

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The datasets it read; ``checkpoint_uri`` (as on start), versioned by its last checkpoint
        (``<run>/orbax/<step>``)."""
        result = self.job_result
        version = checkpoint_dataset(str(result["checkpoint_uri"]))[1] if result.get("checkpoint_uri") else None
        return task_lineage(self.input_datasets(), [storage_dataset(self.checkpoint_uri, version=version)])

    def record_attempts(self, run_name: str) -> None:
        """Push what the run's restarts cost (``training_attempts``) and put it on the outlets' asset events."""
        from airflow.sdk import get_current_context

        attempts_uri = f"{self.checkpoint_uri.rstrip('/')}/{run_name}/{ATTEMPTS_SUBDIR}"
        try:
            files = read_files(attempts_uri, ATTEMPT_PREFIX, self.jobs.cluster_hook.settings.gcp_conn_id)
            progress = training_progress(json.loads(data) for data in files.values())
        except Exception as exc:  # the training succeeded: its task does not fail over a figure
            self.log.warning("Restarts: not counted, the attempts in %s could not be read: %s", attempts_uri, exc)
            return
        if progress is None:
            return  # the loop has no StepClock: nothing was recorded
        self.log.info("Restarts: %s", describe_attempts(progress))
        get_current_context()["ti"].xcom_push(key=TRAINING_ATTEMPTS_XCOM_KEY, value=progress)
        mark_outlets(self, {TRAINING_ATTEMPTS_XCOM_KEY: progress})
