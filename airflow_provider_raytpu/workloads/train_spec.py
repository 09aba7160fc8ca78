"""What one training job does (:class:`TrainSpec`), and where its run keeps what it writes.

Ray Train keeps a run at ``<checkpoint_uri>/<run_name>``: the loop's orbax checkpoints under
``orbax``, step times under ``steps``, profiler traces under ``profile``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.workloads.checkpoints import ORBAX_SUBDIR
from airflow_provider_raytpu.workloads.steps import PROFILE_SUBDIR, STEPS_SUBDIR, profile_window
from airflow_provider_raytpu.workloads.storage import resolve

# Glob characters in a path break gcsfs (orbax's GCS access), and "/" would nest runs.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class TrainSpec:
    """What one training job does.

    :param train_loop: ``"package.module:function"`` of ``train_loop_per_worker(config)``.
    :param tpu: the slice shape the workers run on.
    :param run_name: Ray Train's run name; the same name resumes the same run.
    :param checkpoint_uri: the storage root for runs (``gs://bucket/prefix`` or local).
    :param config: the loop's config (``checkpoint_uri``, ``run_name`` and, if given,
        ``batch_size`` / ``ragged_policy`` are added).
    :param datasets: dataset name -> URI (parquet or JSONL), read with Ray Data and
        split between workers (``ray.train.get_dataset_shard(name)``).
    :param max_failures: worker-group restarts allowed after a failure (``-1``: unlimited).
    :param checkpoints_to_keep: how many newest registered checkpoints Ray Train keeps
        (``CheckpointConfig(num_to_keep)``; ``None`` keeps all). Ray, not orbax, prunes
        registered checkpoints: see ``workloads.checkpoints``.
    :param batch_size: rows per batch on each worker, checked against every dataset.
    :param ragged_policy: ``"drop"``, ``"pad"`` or ``"raise"`` for a short last batch.
    :param profile_steps: ``(first, end)``: the loop's
        :class:`~airflow_provider_raytpu.workloads.steps.StepClock` traces steps
        ``first <= step < end`` with ``jax.profiler`` into ``<run>/profile``.
    :param slices: ``(min, max)``: train elastically on as many whole slices as are ready, at least
        ``min`` and at most ``max`` (of the ``tpu.num_slices`` the cluster has); ``None``: on all of them.
    :param resize_interval: with ``slices``, seconds between Ray Train's checks for more ready slices.
    :param on_config_change: when the run was started with another training config: ``fail``,
        ``start_fresh`` or ``resume`` (:mod:`~airflow_provider_raytpu.workloads.run_record`).
    """

    train_loop: str
    tpu: TpuSlice
    run_name: str
    checkpoint_uri: str
    config: dict[str, Any] = field(default_factory=dict)
    datasets: dict[str, str] = field(default_factory=dict)
    max_failures: int = 0
    checkpoints_to_keep: int | None = 3
    batch_size: int | None = None
    ragged_policy: str | None = None
    profile_steps: tuple[int, int] | None = None
    slices: tuple[int, int] | None = None
    resize_interval: float = 60.0
    on_config_change: str = "fail"

    def __post_init__(self) -> None:
        if self.slices is not None and not 1 <= self.slices[0] <= self.slices[1] <= self.tpu.num_slices:
            raise ValueError(f"slices={self.slices} must be (min, max) with 1 <= min <= max <= "
                             f"{self.tpu.num_slices}, the cluster's slices")
        if self.resize_interval < 0:
            raise ValueError(f"resize_interval={self.resize_interval} must not be negative")
        object.__setattr__(self, "profile_steps", profile_window(self.profile_steps))
        if not _RUN_NAME.fullmatch(self.run_name or ""):
            raise ValueError(
                f"run_name={self.run_name!r} is not a valid run name: it becomes a storage path component, "
                "so use letters, digits, '.', '_' and '-' (starting with a letter or digit)"
            )
        if self.max_failures < -1:
            raise ValueError(f"max_failures={self.max_failures} must be -1 (unlimited) or at least 0")
        if self.checkpoints_to_keep is not None and self.checkpoints_to_keep < 1:
            raise ValueError(f"checkpoints_to_keep={self.checkpoints_to_keep} must be at least 1 (or unset: keep all)")

    @property
    def num_workers(self) -> int:
        """One worker per TPU host: hosts per slice times slices (the most slices, when elastic)."""
        return self.worker_counts[-1]

    @property
    def worker_counts(self) -> list[int]:
        """Every number of workers the run may have: one per host of each slice it trains on."""
        low, high = self.slices or (self.tpu.num_slices, self.tpu.num_slices)
        return [self.tpu.hosts_per_slice * count for count in range(low, high + 1)]

    def run_uri(self) -> str:
        """Where Ray Train keeps this run: ``<checkpoint_uri>/<run_name>``."""
        return resolve(self.checkpoint_uri).child(self.run_name).uri

    def profile_uri(self) -> str:
        """Where the workers' profiler traces go: ``<checkpoint_uri>/<run_name>/profile`` (a TensorBoard logdir)."""
        return resolve(self.checkpoint_uri).child(self.run_name, PROFILE_SUBDIR).uri

    def steps_uri(self) -> str:
        """Where the workers' step-time summaries go: ``<checkpoint_uri>/<run_name>/steps``."""
        return resolve(self.checkpoint_uri).child(self.run_name, STEPS_SUBDIR).uri

    def orbax_uri(self) -> str:
        """Where the loop's orbax checkpoints go: ``<checkpoint_uri>/<run_name>/orbax``."""
        return resolve(self.checkpoint_uri).child(self.run_name, ORBAX_SUBDIR).uri

    def training_config(self) -> dict[str, Any]:
        """What decides what is trained (a resume under another one is refused): not where or on what."""
        return {"train_loop": self.train_loop, "config": self.config, "datasets": self.datasets,
                "batch_size": self.batch_size, "ragged_policy": self.ragged_policy}

    def loop_config(self) -> dict[str, Any]:
        """The config the loop receives."""
        config = dict(self.config)
        config.update(checkpoint_uri=self.orbax_uri(), run_name=self.run_name)
        if self.batch_size is not None:
            config["batch_size"] = self.batch_size
        if self.ragged_policy is not None:
            config["ragged_policy"] = self.ragged_policy
        if self.profile_steps is not None:
            config.update(profile_steps=list(self.profile_steps), profile_uri=self.profile_uri())
        return config
