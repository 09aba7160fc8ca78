"""The JaxTrainer train loop: data-parallel MLP training on one TPU slice, checkpointed with orbax.

Use with the training job::

    python -m airflow_provider_raytpu.workloads.train \\
        --train-loop pipeline.train_loop:train_loop_per_worker --run-name r1 \\
        --tpu '{"accelerator": "v4", "topology": "2x2x2"}' --checkpoint-uri gs://bucket/runs \\
        --config '{"total_steps": 40, "checkpoint_every": 5}'

Config keys (defaults in :data:`DEFAULTS`): ``seed``, ``total_steps``,
``checkpoint_every``, ``batch_size`` (rows per worker per step), ``learning_rate``,
``max_to_keep`` (used outside Ray Train; inside it the job's ``--checkpoints-to-keep``
prunes); ``checkpoint_uri`` comes from the job. With ``eval_dataset`` naming
one of the job's datasets, the final state is evaluated on it, batched by
``ragged_policy`` (``pad`` counts every row exactly once).

Every step's batch derives from ``(seed, step)``, so a run resumed from a checkpoint
at step ``k`` computes exactly what an uninterrupted run computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .model import NUM_FEATURES, init_params, loss_fn, make_optimizer, synthetic_batch

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "total_steps": 40,
    "checkpoint_every": 5,
    "batch_size": 32,
    "learning_rate": 0.01,
    "max_to_keep": 3,
    "eval_dataset": None,
    "ragged_policy": "pad",
}
HOLDOUT_STEP = 2**31 - 1  # a step no run reaches: its batch is held out

AfterStep = Callable[[int, int], None]


def _replicate(tree: Any, sharding: Any) -> Any:
    """Host values (identical on every host) as global arrays replicated over the mesh."""
    import jax

    def to_global(value: Any) -> Any:
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(to_global, tree)


def _evaluate(params: Any, shard: Any, config: dict[str, Any], eval_step: Any) -> dict[str, Any]:
    """Mean squared error over an eval shard; padded rows (mask False) do not count."""
    import jax.numpy as jnp

    from airflow_provider_raytpu.workloads.batches import MASK_COLUMN, iter_batches

    total, rows = 0.0, 0.0
    for batch in iter_batches(
        shard, config["batch_size"], config["ragged_policy"], columns=["features", "y"], dtypes=jnp.float32
    ):
        mask = batch.get(MASK_COLUMN)
        if mask is None:
            mask = jnp.ones(batch["y"].shape, bool)
        sse, count = eval_step(params, batch["features"], batch["y"], mask)
        total += float(sse)
        rows += float(count)
    return {"eval_loss": total / rows if rows else None, "eval_rows": int(rows)}


def train(config: dict[str, Any], after_step: AfterStep | None = None) -> None:
    """Train, checkpointing every ``checkpoint_every`` steps and resuming from the newest checkpoint.

    :param config: the loop config (see module docstring).
    :param after_step: called as ``after_step(step, world_rank)`` after each step
        (progress hooks, fault injection in tests).
    """
    import jax
    import jax.numpy as jnp
    import optax
    import ray.train
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from airflow_provider_raytpu.workloads.checkpoints import TrainCheckpoints
    from airflow_provider_raytpu.workloads.steps import StepClock

    config = {**DEFAULTS, **config}
    seed, total, every = int(config["seed"]), int(config["total_steps"]), int(config["checkpoint_every"])
    rank = ray.train.get_context().get_world_rank()
    per_host = int(config["batch_size"])
    global_rows = per_host * jax.process_count()

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    by_row = NamedSharding(mesh, P("data"))
    optimizer = make_optimizer(float(config["learning_rate"]))
    params = init_params(seed)
    initial = _replicate({"params": params, "opt_state": optimizer.init(params)}, replicated)

    def step_fn(state: Any, features: Any, targets: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], features, targets)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    def eval_fn(params: Any, features: Any, targets: Any, mask: Any) -> tuple[Any, Any]:
        count = mask.astype(jnp.float32).sum()
        return loss_fn(params, features, targets, mask) * count, count

    train_step = jax.jit(step_fn, out_shardings=replicated)
    eval_step = jax.jit(eval_fn, out_shardings=replicated)

    def global_batch(step: int) -> tuple[Any, Any]:
        features, targets = synthetic_batch(seed, step, global_rows)
        rows = slice(jax.process_index() * per_host, (jax.process_index() + 1) * per_host)
        return (
            jax.make_array_from_process_local_data(by_row, features[rows], (global_rows, NUM_FEATURES)),
            jax.make_array_from_process_local_data(by_row, targets[rows], (global_rows,)),
        )

    checkpoints = TrainCheckpoints(config["checkpoint_uri"], max_to_keep=int(config["max_to_keep"]))
    clock = StepClock(config)  # step times for the task log; a JAX trace of config["profile_steps"]
    restored = checkpoints.restore_latest(initial)
    step, state = restored if restored else (0, initial)
    if rank == 0:
        print(f"train_loop: starting at step {step} of {total}", flush=True)

    last_loss = None
    last_saved = step
    while step < total:
        with clock.step(step):
            with clock.data():
                batch = global_batch(step)
            state, loss = train_step(state, *batch)
            last_loss = float(loss)  # waits for the step: JAX dispatches asynchronously
        step += 1
        if after_step is not None:
            after_step(step, rank)
        if step % every == 0 and step < total:
            checkpoints.save(step, state, {"loss": last_loss})
            last_saved = step
            if rank == 0:
                print(f"train_loop: step {step} loss {last_loss:.6f} (checkpoint)", flush=True)

    holdout = synthetic_batch(seed, HOLDOUT_STEP, global_rows)
    rows = slice(jax.process_index() * per_host, (jax.process_index() + 1) * per_host)
    holdout_features = jax.make_array_from_process_local_data(by_row, holdout[0][rows], (global_rows, NUM_FEATURES))
    holdout_targets = jax.make_array_from_process_local_data(by_row, holdout[1][rows], (global_rows,))
    metrics: dict[str, Any] = {
        "loss": last_loss,
        "holdout_loss": float(
            jax.jit(loss_fn, out_shardings=replicated)(state["params"], holdout_features, holdout_targets)),
    }
    if config["eval_dataset"]:
        metrics.update(
            _evaluate(state["params"], ray.train.get_dataset_shard(config["eval_dataset"]), config, eval_step))

    if last_saved < step or restored is None:
        checkpoints.save(step, state, metrics)  # the final state, always checkpointed
    else:
        checkpoints.register(step, metrics)  # resumed at the end: nothing new to save
    checkpoints.close()
    clock.close()
    if rank == 0:
        print(f"train_loop: done at step {step}: {metrics}", flush=True)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The function JaxTrainer runs on every worker (one per TPU host).

    :param config: the loop config.
    """
    train(config)
