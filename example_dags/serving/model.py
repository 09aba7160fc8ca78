"""A tiny Flax MLP served over HTTP by Ray Serve; its parameters derive from the model version.

The Serve config passes the version (and the checkpoint URI it names) as the builder's
args, so promoting a RayService to a new version changes the answers, and an answer says
which version produced it::

    POST /      {"inputs": [[0.1, 0.2, 0.3, 0.4], ...]}  ->  {"version": ..., "predictions": [...]}
    GET /health                                           ->  {"status": "ok", "version": ...}

``fail_at_start`` makes every replica raise in its constructor (to see a failed deploy).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray import serve

NUM_FEATURES = 4
HIDDEN = 16


def seed_of(version: str) -> int:
    """The PRNG seed a version's parameters derive from (stands in for loading its checkpoint)."""
    return int(hashlib.sha256(version.encode()).hexdigest()[:8], 16)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=32)
class TinyModel:
    """A 2-layer MLP; JAX runs on the CPU of whatever host the replica lands on."""

    def __init__(self, model_version: str, checkpoint_uri: str | None = None, fail_at_start: str | None = None,
                 features: int = NUM_FEATURES) -> None:
        if fail_at_start:
            raise RuntimeError(fail_at_start)
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                return nn.Dense(1)(nn.tanh(nn.Dense(HIDDEN)(x)))[:, 0]

        self.version = model_version
        self.checkpoint_uri = checkpoint_uri or model_version
        self.features = features
        model = MLP()
        params = model.init(jax.random.PRNGKey(seed_of(self.checkpoint_uri)), jnp.zeros((1, features)))
        self._predict = jax.jit(lambda x: model.apply(params, x))
        self._jnp = jnp
        self._predict(jnp.zeros((1, features))).block_until_ready()  # compile before taking traffic

    async def __call__(self, request: Any) -> dict[str, Any]:
        if request.url.path.rstrip("/").endswith("/health"):
            return {"status": "ok", "version": self.version}
        body = await request.json()
        inputs = self._jnp.asarray(body["inputs"], dtype=self._jnp.float32).reshape(-1, self.features)
        predictions = self._predict(inputs)
        return {"version": self.version, "checkpoint_uri": self.checkpoint_uri,
                "predictions": [float(p) for p in predictions]}


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application builder (``import_path: serving.model:build_app``).

    :param args: ``model_version`` (required), ``checkpoint_uri``, ``features``, ``fail_at_start``.
    """
    return TinyModel.bind(
        model_version=str(args["model_version"]),
        checkpoint_uri=args.get("checkpoint_uri"),
        fail_at_start=args.get("fail_at_start"),
        features=int(args.get("features", NUM_FEATURES)),
    )
