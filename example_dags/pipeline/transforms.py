"""Batch transforms for the preprocessing job (Ray Data ``map_batches``).

- :func:`normalise` is a plain function: stateless, runs as Ray tasks.
- :class:`Embedder` is a callable class: its ``__init__`` builds a (tiny, deterministic)
  Flax embedding model once per actor, and ``__call__`` embeds each batch - the shape of
  any model-serving transform, run as an actor pool, e.g. one TPU host per actor.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np

from .data import RAW_SCALE, RAW_SHIFT

MAX_TOKENS = 16
HASH_BUCKETS = 1024  # token id 0 is padding
_WORD = re.compile(r"[a-z0-9]+")


def token_ids(text: str, max_tokens: int = MAX_TOKENS, buckets: int = HASH_BUCKETS) -> list[int]:
    """Hash the words of ``text`` to ids in ``[1, buckets)`` (stable across processes), padded with 0.

    :param text: already lower-cased text.
    :param max_tokens: output length (longer texts are cut).
    :param buckets: hash buckets including the padding id 0.
    """
    ids = [zlib.crc32(word.encode()) % (buckets - 1) + 1 for word in _WORD.findall(text)][:max_tokens]
    return ids + [0] * (max_tokens - len(ids))


def _as_matrix(column: Any, dtype: Any) -> np.ndarray:
    """A list column as a 2-D array (Ray hands lists over as an object array of arrays)."""
    column = np.asarray(column)
    if column.dtype == object:
        column = np.stack([np.asarray(v) for v in column]) if len(column) else np.zeros((0, 0))
    return column.astype(dtype)


def normalise(batch: dict[str, np.ndarray], max_tokens: int = MAX_TOKENS) -> dict[str, np.ndarray]:
    """Lower-case and tokenise the text, and standardise the raw features.

    Input columns ``id, text, x, y``; output ``id, text, tokens, features, y``.

    :param batch: a numpy batch.
    :param max_tokens: tokens per row.
    """
    texts = [" ".join(_WORD.findall(str(t).lower())) for t in batch["text"]]
    features = (_as_matrix(batch["x"], np.float32) - RAW_SHIFT) / RAW_SCALE
    return {
        "id": np.asarray(batch["id"], dtype=np.int64),
        "text": np.asarray(texts, dtype=object),
        "tokens": np.asarray([token_ids(t, max_tokens) for t in texts], dtype=np.int32).reshape(len(texts), max_tokens),
        "features": features.astype(np.float32),
        "y": np.asarray(batch["y"], dtype=np.float32),
    }


class Embedder:
    """Embed token ids with a small Flax model built once per actor (deterministic: fixed seed, no download).

    :param dim: embedding width.
    :param buckets: vocabulary size (hash buckets), as in :func:`token_ids`.
    :param seed: the model's initialisation seed.
    """

    def __init__(self, dim: int = 16, buckets: int = HASH_BUCKETS, seed: int = 0) -> None:
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        class TokenEncoder(nn.Module):
            @nn.compact
            def __call__(self, tokens: Any) -> Any:
                vectors = nn.Embed(buckets, dim)(tokens)
                mask = (tokens > 0)[..., None].astype(vectors.dtype)
                pooled = (vectors * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
                return nn.tanh(nn.Dense(dim)(pooled))

        model = TokenEncoder()
        self.params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, MAX_TOKENS), jnp.int32))
        self._apply = jax.jit(model.apply)
        self.dim = dim

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Add an ``embedding`` column (``dim`` floats per row).

        :param batch: a numpy batch with a ``tokens`` column (from :func:`normalise`),
            or raw rows with ``text``, which are tokenised first.
        """
        if "tokens" in batch:
            tokens = _as_matrix(batch["tokens"], np.int32)
        else:
            texts = [" ".join(_WORD.findall(str(t).lower())) for t in batch["text"]]
            tokens = np.asarray([token_ids(t) for t in texts], dtype=np.int32).reshape(len(texts), MAX_TOKENS)
        out = dict(batch)
        out["embedding"] = np.asarray(self._apply(self.params, tokens), dtype=np.float32).reshape(len(tokens), self.dim)
        return out
