"""JaxTrainer job: run a user's ``train_loop_per_worker`` on one or more whole TPU slices.

Run as a Ray job driver::

    python -m airflow_provider_raytpu.workloads.train \\
        --train-loop pipeline.train_loop:train_loop_per_worker \\
        --tpu '{"accelerator": "v4", "topology": "2x2x2"}' \\
        --run-name my-run --checkpoint-uri gs://bucket/checkpoints

The worker count and Ray's TPU placement follow from the slice shape (``TpuSlice``).
Ray Train keeps the run at ``<checkpoint-uri>/<run-name>``; the loop's config gets
``checkpoint_uri`` = ``<checkpoint-uri>/<run-name>/orbax`` for
:class:`~airflow_provider_raytpu.workloads.checkpoints.TrainCheckpoints`. Re-running
with the same run name resumes from the newest checkpoint in storage; a failed worker
is restarted up to ``--max-failures`` times.

The job prints ``RAYTPU_RESULT {"metrics", "checkpoint_uri", "steps",
"resumed_from_step", "run_name", "seconds", "step_time", "profile_uri"}``.

This module does not import JAX (nor the user's loop) in the driver process: the loop
is imported by the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.workloads.batches import POLICIES, RaggedBatchError, check_batches
from airflow_provider_raytpu.workloads.failures import describe_failure
from airflow_provider_raytpu.workloads.loading import check_importable, load_object
from airflow_provider_raytpu.workloads.result import EXIT_BAD_INPUT, report_result
from airflow_provider_raytpu.workloads.run_record import ON_CONFIG_CHANGE, TrainingConfigChangedError, settle_run
from airflow_provider_raytpu.workloads.slice_reservations import SliceHeadJanitor
from airflow_provider_raytpu.workloads.steps import (
    combine_step_times,
    read_step_times,
)
from airflow_provider_raytpu.workloads.storage import delete_prefix, exists, resolve, uri_for
from airflow_provider_raytpu.workloads.train_spec import TrainSpec

if TYPE_CHECKING:
    from ray.train.base_trainer import GenDataset  # the datasets type of JaxTrainer (v2) too
    from ray.train.v2.api.config import ScalingConfig
    from ray.train.v2.jax import JaxTrainer

EXIT_FAILED = 1
def run_user_loop(import_path: str, config: dict[str, Any], hosts_per_slice: int = 1) -> Any:
    """Runs on each worker: import the user's loop there and call it with ``config``.

    :param import_path: ``"package.module:function"``.
    :param config: the loop's config.
    :param hosts_per_slice: hosts (workers) of one slice.
    """
    from airflow_provider_raytpu.workloads.session import quiet_report_records

    quiet_report_records()
    forget_other_slices(hosts_per_slice)
    return load_object(import_path)(config)


def forget_other_slices(hosts_per_slice: int) -> None:
    """On a worker group of one slice, drop the ``MEGASCALE_*`` variables its pod was started with.

    GKE's TPU webhook gives every host of a multi-slice worker group ``MEGASCALE_NUM_SLICES`` and its slice's
    id; libtpu reads them when JAX's TPU backend starts, in the loop. Ray Train sets them afresh for a worker
    group of several slices, but for one slice it sets none (``_JaxBackend.on_start`` in
    ray/train/v2/jax/config.py), so an elastic run left with one slice would wait for slices it no longer has.
    """
    import ray.train

    if ray.train.get_context().get_world_size() > hosts_per_slice:
        return
    for name in [name for name in os.environ if name.startswith("MEGASCALE_")]:
        del os.environ[name]


def scaling_config(
    tpu: TpuSlice, slices: tuple[int, int] | None = None, resize_interval: float = 60.0
) -> ScalingConfig:
    """Ray Train's ScalingConfig for whole slices of ``tpu``'s shape: one worker per host, holding its chips.

    The per-host chips are given, not left to Ray: ``get_tpu_worker_resources`` (ray/util/tpu.py) assumes
    one 8-chip host for a v5e/v6e 2x4, so on two 4-chip hosts (``chips_per_host=4``, GKE's two
    ct6e-standard-4t) it would ask for workers of 8 chips that no host has.

    With ``slices``, ``num_workers`` is Ray Train's elastic ``(min_workers, max_workers)``: its elastic
    scaling policy counts only whole slices that are ready (``_get_strict_tpu_worker_count`` in
    ray/train/v2/_internal/execution/scaling_policy/elastic.py), starts on as many as there are, and every
    ``resize_interval`` seconds restarts the workers on more once more are ready.

    :param tpu: the slice shape.
    :param slices: ``(min, max)`` slices to train on, elastically; ``None``: all of ``tpu.num_slices``.
    :param resize_interval: Ray's ``elastic_resize_monitor_interval_s``.
    """
    from ray.train.v2.api.config import ScalingConfig  # ray.train's under Ray Train v2 (RAY_TRAIN_V2_ENABLED)

    hosts = tpu.hosts_per_slice
    whole_slices = functools.partial(
        ScalingConfig,
        use_tpu=True,
        topology=tpu.topology,
        accelerator_type=tpu.ray_accelerator_type,
        resources_per_worker={"CPU": 1, "TPU": float(tpu.host_chips)},
    )
    if slices:
        return whole_slices(
            num_workers=(slices[0] * hosts, slices[1] * hosts), elastic_resize_monitor_interval_s=resize_interval
        )
    return whole_slices(num_workers=hosts * tpu.num_slices)


def check_datasets(spec: TrainSpec, datasets: dict[str, Any]) -> None:
    """Fail before training if a dataset does not batch under the ragged policy.

    :param spec: the job description (``batch_size`` and ``ragged_policy``).
    :param datasets: name -> ``ray.data.Dataset``.
    """
    if spec.batch_size is None or spec.ragged_policy is None:
        return
    for name, dataset in datasets.items():
        rows = dataset.count()
        try:
            for workers in spec.worker_counts:
                check_batches(rows, spec.batch_size, workers, spec.ragged_policy)
        except ValueError as error:
            raise type(error)(f"dataset {name!r} ({spec.datasets[name]}): {error}") from None


def build_trainer(spec: TrainSpec) -> tuple[JaxTrainer, TrainSpec]:
    """The JaxTrainer for ``spec`` (connect to Ray first), and the spec it trains: once the datasets are checked,
    the run is settled against the config it was started with (a new run name with ``start_fresh``), so a job
    refused before training records nothing.

    :param spec: the job description.
    """
    # Ray Train v2's, which ``ray.train``'s are when it runs (RAY_TRAIN_V2_ENABLED, on by default).
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.jax import JaxTrainer

    from airflow_provider_raytpu.workloads.datasets import read_dataset

    datasets: dict[str, GenDataset] = {name: read_dataset(uri) for name, uri in spec.datasets.items()}
    check_datasets(spec, datasets)
    storage = resolve(spec.checkpoint_uri)
    settled = settle_run(storage, spec.run_name, spec.training_config(), spec.on_config_change)
    if settled != spec.run_name:
        print(f"The training config changed since run {spec.run_name} started: training a new run, {settled}, "
              "from step 0 (on_config_change='start_fresh')")
        spec = dataclasses.replace(spec, run_name=settled)
    return JaxTrainer(
        functools.partial(run_user_loop, spec.train_loop, hosts_per_slice=spec.tpu.hosts_per_slice),
        train_loop_config=spec.loop_config(),
        scaling_config=scaling_config(spec.tpu, spec.slices, spec.resize_interval),
        run_config=RunConfig(
            name=spec.run_name,
            storage_path=storage.path,
            storage_filesystem=storage.filesystem,
            failure_config=FailureConfig(max_failures=spec.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoints_to_keep),
        ),
        datasets=datasets or None,
    ), spec


def summarize(spec: TrainSpec, result: Any, seconds: float) -> dict[str, Any]:
    """The job's result from Ray Train's Result: final metrics, newest checkpoint, steps, step times, traces.

    The metrics are those rank 0 reported with the newest checkpoint
    (``TrainCheckpoints`` adds ``step``, ``resumed_from_step`` and ``checkpoint_uri``).
    ``step_time`` is what the workers' ``StepClock`` recorded (``None`` without one);
    ``profile_uri`` is the TensorBoard logdir when a trace was written, else ``None``.

    :param spec: the job description.
    :param result: ``trainer.fit()``'s Result.
    :param seconds: the job's wall time.
    """
    metrics = dict(result.metrics or {})
    step_time = combine_step_times(read_step_times(spec.steps_uri()))
    checkpoint = getattr(result, "checkpoint", None)
    checkpoint_uri = uri_for(checkpoint.filesystem, checkpoint.path) if checkpoint else metrics.get("checkpoint_uri")
    return {
        "metrics": metrics,
        "checkpoint_uri": checkpoint_uri,
        "steps": metrics.get("step"),
        "resumed_from_step": metrics.get("resumed_from_step"),
        "run_name": spec.run_name,
        "seconds": round(seconds, 3),
        "step_time": step_time,
        "profile_uri": spec.profile_uri() if spec.profile_steps and exists(spec.profile_uri()) else None,
    }


def run_training(spec: TrainSpec) -> dict[str, Any]:
    """Run the job in this process (connecting to Ray if needed) and return its result.

    :param spec: the job description.
    :raises ImportError: when the loop's module cannot be found.
    :raises RaggedBatchError: before training, when a dataset does not batch under "raise".
    :raises ray.train.TrainingFailedError: when training fails beyond ``max_failures``.
    """
    from airflow_provider_raytpu.workloads.session import connect

    started = time.monotonic()
    check_importable(spec.train_loop)  # before connecting: a typo fails in a second
    connected = connect()
    try:
        trainer, spec = build_trainer(spec)
        delete_prefix(spec.steps_uri())  # the step times of an earlier attempt
        with SliceHeadJanitor() if spec.tpu.is_multi_host else contextlib.nullcontext():
            result = trainer.fit()
    finally:
        if connected:
            import ray

            ray.shutdown()
    return summarize(spec, result, time.monotonic() - started)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> TrainSpec:
    """Parse the command line into a :class:`TrainSpec`.

    :param argv: arguments without the program name; ``sys.argv[1:]`` if ``None``.
    """
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_raytpu.workloads.train")
    parser.add_argument("--train-loop", required=True, help="package.module:train_loop_per_worker")
    parser.add_argument("--tpu", required=True, type=_json_object, help="TpuSlice.to_dict() as JSON")
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--checkpoint-uri", required=True, help="gs://bucket/prefix or a local path")
    parser.add_argument("--config", type=_json_object, default={})
    parser.add_argument("--datasets", type=_json_object, default={}, help='JSON {"train": "gs://..."}')
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument(
        "--checkpoints-to-keep", type=int, default=3, help="newest registered checkpoints to keep; 0 keeps all"
    )
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--ragged-policy", choices=POLICIES, default=None)
    parser.add_argument("--profile-steps", type=int, nargs=2, default=None, metavar=("FIRST", "END"),
                        help="trace steps FIRST <= step < END with jax.profiler")
    parser.add_argument("--slices", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="train elastically on MIN to MAX of the cluster's slices")
    parser.add_argument("--resize-interval", type=float, default=60.0,
                        help="with --slices, seconds between checks for more ready slices")
    parser.add_argument("--on-config-change", choices=ON_CONFIG_CHANGE, default="fail",
                        help="when the run was started with another training config")
    args = parser.parse_args(argv)
    if (args.batch_size is None) != (args.ragged_policy is None):
        parser.error("--batch-size and --ragged-policy go together")
    return TrainSpec(
        train_loop=args.train_loop,
        tpu=TpuSlice.from_dict(args.tpu),
        run_name=args.run_name,
        checkpoint_uri=args.checkpoint_uri,
        config=args.config,
        datasets={str(k): str(v) for k, v in args.datasets.items()},
        max_failures=args.max_failures,
        checkpoints_to_keep=args.checkpoints_to_keep or None,
        batch_size=args.batch_size,
        ragged_policy=args.ragged_policy,
        profile_steps=tuple(args.profile_steps) if args.profile_steps else None,
        slices=tuple(args.slices) if args.slices else None,
        resize_interval=args.resize_interval,
        on_config_change=args.on_config_change,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, train, print the result line. Returns the process exit code.

    :param argv: arguments without the program name.
    """
    try:
        spec = parse_args(argv)
    except ValueError as error:  # InvalidInputError from the slice shape
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        result = run_training(spec)
    except (RaggedBatchError, ImportError, FileNotFoundError, TrainingConfigChangedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:
        from ray.train.v2.api.exceptions import TrainingFailedError  # what ray.train's is under Ray Train v2

        if not isinstance(error, TrainingFailedError):
            raise
        print(describe_failure(error), file=sys.stderr)
        return EXIT_FAILED
    report_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
