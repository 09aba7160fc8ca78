"""Orbax checkpoints for a JAX train loop, written straight to the run's storage and registered with Ray Train.

Every host writes its own shards directly to storage (``gs://`` or local) with an
orbax ``CheckpointManager`` - asynchronously, so training continues while a save is
in flight. There is no local copy and no upload step: rank 0 only *registers* the
committed step directory with Ray Train (``ray.train.report(...,
checkpoint_upload_mode=NO_UPLOAD)``), so the run's Result and Ray's checkpoint list
name it.

A step is registered only once committed: at the next save (or at :meth:`wait` /
:meth:`close`), so Ray's record lags orbax by one save. Restore never trusts Ray's
record: :meth:`TrainCheckpoints.restore_latest` asks orbax for the newest *committed*
step in storage. A step directory left half-written by a
crash (a ``*.orbax-checkpoint-tmp-*`` directory locally, a step prefix without
``commit_success.txt`` on GCS) is not a committed step; it is deleted when the
manager opens, so neither the next restore nor the next save trips over it.

Retention has exactly one owner. Outside Ray Train, orbax keeps the ``max_to_keep``
newest steps. Inside Ray Train, orbax deletes nothing and Ray's
``CheckpointConfig(num_to_keep=N)`` does (the training job sets it): Ray refuses to
resume a run whose snapshot names a directory that no longer exists
(``CheckpointManagerInitializationError``), and orbax, deleting on its own schedule,
would remove steps Ray still names.

Typical loop::

    ckpt = TrainCheckpoints(config["checkpoint_uri"], max_to_keep=3)
    restored = ckpt.restore_latest(initial_state)
    step, state = restored if restored else (0, initial_state)
    while step < total_steps:
        state, loss = train_step(state, batch_for(seed, step)); step += 1
        if step % every == 0 or step == total_steps:
            ckpt.save(step, state, {"loss": loss})
    ckpt.close()   # waits for the last save and registers it

Every worker must make the same calls in the same order: orbax and
``ray.train.report`` both synchronise across hosts.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.storage import Location, apply_emulator_env, resolve, uri_for

log = logging.getLogger(__name__)

ORBAX_SUBDIR = "orbax"


def in_train_worker() -> bool:
    """Whether this code runs inside a Ray Train training function."""
    try:
        import ray.train

        ray.train.get_context()
    except (ImportError, RuntimeError):
        return False
    return True


def run_uri() -> str:
    """The run's directory inside a Ray Train worker: ``<storage>/<run name>``."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    return uri_for(storage.storage_filesystem, storage.experiment_fs_path.rstrip("/"))


def run_checkpoint_uri() -> str:
    """The default checkpoint URI inside a Ray Train worker: ``<storage>/<run name>/orbax``."""
    return f"{run_uri()}/{ORBAX_SUBDIR}"


def _number(value: Any) -> Any:
    """A metric value Ray can store: plain ints/floats for numeric scalars (NaN/inf as None)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TrainCheckpoints:
    """Save and restore a train loop's state with orbax, directly in the run's storage.

    :param storage_uri: the directory for step checkpoints (``gs://bucket/.../orbax``
        or a local path). Inside Ray Train, ``None`` means ``<storage>/<run>/orbax``;
        to be registered with Ray Train it must lie inside the run's directory.
    :param max_to_keep: how many most recent steps orbax keeps. Ignored for steps
        registered with Ray Train, whose retention is ``CheckpointConfig(num_to_keep)``
        (see the module docstring).
    :param async_save: save in the background while training continues (orbax async
        checkpointing); each save first waits for the previous one.
    :param report: register committed steps with ``ray.train.report``; by default
        whenever this runs inside a Ray Train worker.
    :param quiet: lower absl logging (orbax's) and fsspec's (gcsfs's) to warnings in this
        process; orbax logs several INFO lines per array and save, fsspec one per file it
        opens, which swamps the job's log.
    """

    def __init__(
        self,
        storage_uri: str | None = None,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        report: bool | None = None,
        quiet: bool = True,
    ) -> None:
        import orbax.checkpoint as ocp

        if quiet:
            from absl import logging as absl_logging

            absl_logging.set_verbosity(absl_logging.WARNING)
            logging.getLogger("fsspec").setLevel(logging.WARNING)
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be at least 1")
        apply_emulator_env()
        self._report = in_train_worker() if report is None else report
        if storage_uri is None:
            if not in_train_worker():
                raise ValueError("storage_uri is required outside a Ray Train worker")
            storage_uri = run_checkpoint_uri()
        self.location: Location = resolve(storage_uri)
        self.resumed_from_step: int | None = None
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._ray_storage = self._run_storage() if self._report else None
        if self._report and self._ray_storage is None:
            log.warning(
                "checkpoints in %s are outside the Ray Train run directory; orbax saves, restores and "
                "prunes them, but they are not registered with Ray Train",
                self.uri,
            )
        registered = self._ray_storage is not None
        self._manager = ocp.CheckpointManager(
            self.location.orbax_path,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if registered else max_to_keep,
                create=True,
                # Delete step directories a crash left uncommitted before anything else.
                cleanup_tmp_directories=True,
                enable_async_checkpointing=async_save,
            ),
        )

    @property
    def uri(self) -> str:
        """The checkpoint directory's URI."""
        return self.location.uri

    def step_uri(self, step: int) -> str:
        """The URI of one step's directory.

        :param step: the training step.
        """
        return self.location.child(str(step)).uri

    def all_steps(self) -> list[int]:
        """The committed steps in storage, oldest first."""
        self._manager.reload()  # read storage, not the manager's cached view
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step in storage, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore_latest(self, template: Any) -> tuple[int, Any] | None:
        """Restore the newest committed step, or return ``None`` when there is none (a fresh start).

        :param template: a pytree shaped like the saved state - concrete arrays or
            ``jax.ShapeDtypeStruct`` - whose shardings say where restored arrays go.
        """
        step = self.latest_step()
        if step is None:
            return None
        state = self.restore_step(step, template)
        self.resumed_from_step = step
        log.info("restored step %d from %s", step, self.uri)
        if self._ray_storage is not None and not self._is_rays_latest(step):
            # Committed before a crash but never registered: register it with the next
            # report, so Ray's record catches up and its retention covers this step too.
            self._pending = (step, self._metrics(step, None))
        return step, state

    def restore_step(self, step: int, template: Any) -> Any:
        """Restore one committed step, e.g. the checkpoint a serving replica was promoted to.

        :param step: the training step.
        :param template: a pytree shaped like the saved state (see :meth:`restore_latest`).
        """
        import orbax.checkpoint as ocp

        return self._manager.restore(step, args=ocp.args.StandardRestore(template))

    def save(self, step: int, state: Any, metrics: dict[str, Any] | None = None) -> None:
        """Start saving ``state`` as ``step``; register it with Ray Train once committed.

        Returns as soon as the arrays are copied off the device (async); the step is
        registered at the next :meth:`save`, :meth:`wait` or :meth:`close`, after orbax
        has committed it, so Ray never names a half-written checkpoint.

        :param step: the training step the state is at (one directory per step).
        :param state: the pytree to save (params, optimizer state, ...).
        :param metrics: numbers to report with this step; ``step`` and
            ``resumed_from_step`` are added.
        """
        import orbax.checkpoint as ocp

        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        # save() waited for the previous save to finish, so that one is committed now.
        self._register_pending()
        self._pending = (step, self._metrics(step, metrics))

    def wait(self) -> None:
        """Block until the last save is committed, then register it with Ray Train."""
        self._manager.wait_until_finished()
        self._register_pending()

    def register(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Register an already committed step with Ray Train (e.g. a run resumed at its end).

        If Ray already names this step as its latest checkpoint (a finished run run
        again), the metrics are reported without a checkpoint and Ray's Result keeps
        the metrics it recorded with that checkpoint.

        :param step: a step in :meth:`all_steps`.
        :param metrics: numbers to report with it.
        """
        self._manager.wait_until_finished()
        if self._pending is not None and self._pending[0] == step:
            self._pending = None  # registered once, below, with these metrics
        else:
            self._register_pending()
        self._report_step(step, self._metrics(step, metrics))

    def close(self) -> None:
        """Wait for the last save, register it, and release orbax's resources."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> TrainCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metrics(self, step: int, metrics: dict[str, Any] | None) -> dict[str, Any]:
        data = {k: _number(v) for k, v in (metrics or {}).items()}
        data.update(step=int(step), resumed_from_step=self.resumed_from_step, checkpoint_uri=self.step_uri(step))
        return data

    def _register_pending(self) -> None:
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            self._report_step(step, metrics)

    def _run_storage(self) -> Any:
        """Ray Train's storage context if our directory lies inside the run's, else ``None``."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        experiment = storage.experiment_fs_path.rstrip("/")
        same_fs = type(storage.storage_filesystem) is type(self.location.filesystem)
        inside = (self.location.path + "/").startswith(experiment + "/")
        return storage if same_fs and inside else None

    def _report_step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._report:
            return
        import ray.train
        from ray.train import CheckpointUploadMode

        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            checkpoint = self._ray_checkpoint(step)
        # Every rank reports (it is a barrier); only rank 0 names the checkpoint.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    def _ray_checkpoint(self, step: int) -> Any:
        from ray.train import Checkpoint

        if self._ray_storage is None:
            return None
        if self._is_rays_latest(step):
            # Registering the same directory twice would let Ray's retention delete it
            # while the newer entry still names it.
            return None
        # Use the run's own filesystem object: Ray accepts only checkpoints on it.
        filesystem, path = self._ray_storage.storage_filesystem, self.location.child(str(step)).path
        if isinstance(filesystem, pafs.GcsFileSystem):
            # Ray prunes an old checkpoint with delete_dir, which ends by deleting the directory's
            # marker object; orbax writes none, so every prune logged a NOT_FOUND traceback.
            filesystem.create_dir(path, recursive=True)
        return Checkpoint(path=path, filesystem=filesystem)

    def _is_rays_latest(self, step: int) -> bool:
        """Whether Ray Train's latest registered checkpoint is this step's directory."""
        import ray.train

        latest = ray.train.get_checkpoint()
        return latest is not None and latest.path.rstrip("/") == self.location.child(str(step)).path
