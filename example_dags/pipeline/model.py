"""A small Flax MLP regressor whose training batches derive from (seed, step).

Deriving every batch from ``(seed, step)`` - not from a data iterator - makes a run
reproducible across restarts: resuming at step ``k`` sees exactly the batches an
uninterrupted run would have seen, since a Ray Data iterator's position is not
part of any checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NUM_FEATURES = 8
HIDDEN = 32


def target_function(features: np.ndarray) -> np.ndarray:
    """The ground truth the model learns (shared with ``data.py``): a smooth nonlinear function.

    :param features: ``(rows, NUM_FEATURES)`` float array.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] - 0.3 * x[:, 3] + 0.1 * x[:, 4:].sum(axis=1)
    return y.astype(np.float32)


def synthetic_batch(seed: int, step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The global training batch for ``step``: same ``(seed, step)``, same rows, on any host, in any run.

    :param seed: the run's seed.
    :param step: the training step (0-based).
    :param rows: rows in the global batch.
    """
    rng = np.random.default_rng([seed, step])
    features = rng.normal(size=(rows, NUM_FEATURES)).astype(np.float32)
    return features, target_function(features)


def make_model() -> Any:
    """The Flax module: two hidden ReLU layers and a scalar output."""
    import flax.linen as nn

    class MLPRegressor(nn.Module):
        hidden: int = HIDDEN

        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.relu(nn.Dense(self.hidden)(x))
            x = nn.relu(nn.Dense(self.hidden)(x))
            return nn.Dense(1)(x)[..., 0]

    return MLPRegressor()


def init_params(seed: int) -> Any:
    """Initial parameters, a pure function of ``seed``.

    :param seed: the run's seed.
    """
    import jax
    import jax.numpy as jnp

    return make_model().init(jax.random.PRNGKey(seed), jnp.zeros((1, NUM_FEATURES), jnp.float32))["params"]


def make_optimizer(learning_rate: float) -> Any:
    """Adam with a fixed learning rate.

    :param learning_rate: the step size.
    """
    import optax

    return optax.adam(learning_rate)


def loss_fn(params: Any, features: Any, targets: Any, mask: Any = None) -> Any:
    """Mean squared error; with ``mask``, only rows whose mask is true count.

    :param params: model parameters.
    :param features: ``(rows, NUM_FEATURES)``.
    :param targets: ``(rows,)``.
    :param mask: optional ``(rows,)`` booleans (padded rows False).
    """
    import jax.numpy as jnp

    errors = (make_model().apply({"params": params}, features) - targets) ** 2
    if mask is None:
        return errors.mean()
    weights = mask.astype(errors.dtype)
    return (errors * weights).sum() / jnp.maximum(weights.sum(), 1.0)
