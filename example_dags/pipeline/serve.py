"""Serve the fine-tuned regressor with Ray Serve, straight from its orbax checkpoint.

The RayService's version is the checkpoint URI the training task returned
(``gs://.../<run>/orbax/<step>``); promoting the service to a new checkpoint loads it::

    POST /      {"inputs": [[x0, ..., x7], ...]}  ->  {"version": ..., "predictions": [...]}
    GET /health                                   ->  {"status": "ok", "version": ...}
"""

from __future__ import annotations

from typing import Any

from ray import serve

from .model import NUM_FEATURES, init_params, make_model, make_optimizer
from .train_loop import DEFAULTS


def load_params(checkpoint_uri: str, seed: int, learning_rate: float) -> Any:
    """The model parameters saved at ``<run>/orbax/<step>``.

    :param checkpoint_uri: a step directory written by the train loop.
    :param seed: the run's seed (shapes the restore template).
    :param learning_rate: the run's learning rate (shapes the optimizer state).
    """
    from airflow_provider_raytpu.workloads.checkpoints import TrainCheckpoints

    directory, _, step = checkpoint_uri.rstrip("/").rpartition("/")
    params = init_params(seed)
    template = {"params": params, "opt_state": make_optimizer(learning_rate).init(params)}
    with TrainCheckpoints(directory, report=False, async_save=False) as checkpoints:
        return checkpoints.restore_step(int(step), template)["params"]


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=32)
class Regressor:
    """The regressor of ``model.py`` with the parameters of one checkpoint."""

    def __init__(self, checkpoint_uri: str, seed: int = DEFAULTS["seed"],
                 learning_rate: float = DEFAULTS["learning_rate"]) -> None:
        import jax
        import jax.numpy as jnp

        params = load_params(checkpoint_uri, seed, learning_rate)
        model = make_model()
        self.version = checkpoint_uri
        self._predict = jax.jit(lambda x: model.apply({"params": params}, x))
        self._jnp = jnp
        self._predict(jnp.zeros((1, NUM_FEATURES), jnp.float32)).block_until_ready()  # compile before traffic

    async def __call__(self, request: Any) -> dict[str, Any]:
        if request.url.path.rstrip("/").endswith("/health"):
            return {"status": "ok", "version": self.version}
        body = await request.json()
        inputs = self._jnp.asarray(body["inputs"], dtype=self._jnp.float32).reshape(-1, NUM_FEATURES)
        return {"version": self.version, "predictions": [float(p) for p in self._predict(inputs)]}


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application builder (``import_path: pipeline.serve:build_app``).

    :param args: ``checkpoint_uri`` (required), ``seed``, ``learning_rate``.
    """
    return Regressor.bind(
        checkpoint_uri=str(args["checkpoint_uri"]),
        seed=int(args.get("seed", DEFAULTS["seed"])),
        learning_rate=float(args.get("learning_rate", DEFAULTS["learning_rate"])),
    )
