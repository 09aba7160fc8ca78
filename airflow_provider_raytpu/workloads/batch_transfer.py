"""Numpy batches to globally sharded JAX arrays with the output of Ray's ``iter_jax_batches``, in fewer transfers.

Ray (``ray/data/util/jax_util.py``, ``_convert_batch``) calls
``jax.make_array_from_process_local_data(sharding, column, global_shape)`` once per column,
then ``.astype(dtype)`` per column when ``dtypes`` names one. Each call has a fixed cost
(≈ 75 µs on the CPU) that dominates small columns. Here one batch costs one call:

- ``make_array_from_process_local_data`` takes a pytree, so all columns of a batch go in one
  call with the same sharding and global shapes as Ray's per-column calls (JAX converts
  each leaf exactly as it would alone);
- columns of at most :data:`STACK_MAX_BYTES` that share a dtype and trailing shape are
  stacked on the host into one array first, and split back on the devices by a cached
  jitted function that also applies the ``dtypes`` casts, under the same sharding.
  Stacking large columns costs more in copies than it saves in calls, hence the limit.

Slicing is exact and ``astype`` inside ``jit`` is the same XLA conversion as Ray's eager
``astype``, so values, dtypes, shapes and shardings are those of Ray's path; the test
``tests/workloads/test_batches.py`` checks it element by element on 4 emulated devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

STACK_MAX_BYTES = 32 * 1024
"""Largest column (bytes in one batch) that is stacked with its like; larger ones are sent as they are."""


def ray_conversion() -> tuple[Any, Any] | None:
    """Ray's sharding builder and per-column converter, or None when this Ray does not have them.

    The fast path takes the sharding from Ray itself, so its arrays carry exactly Ray's
    mesh, and uses Ray's converter to reproduce Ray's error for a batch it cannot convert.
    """
    try:
        from airflow_provider_raytpu.workloads.ray_compat import jax_util
    except ImportError:
        return None
    return (lambda: jax_util._create_sharding_1d(jax_util._GLOBAL_MESH_1D_AXIS)), jax_util._convert_batch


def _column_dtype(dtypes: Any, name: str) -> Any:
    # As ray.data.util.jax_util._get_column_value: a dict is looked up (KeyError if the
    # column is missing, as in Ray), anything else applies to every column.
    return dtypes[name] if isinstance(dtypes, dict) else dtypes


class BatchTransfer:
    """Converts numpy batches (``dict`` of column arrays) of one iteration to sharded JAX arrays.

    :param sharding: the sharding of every array (Ray's 1-D ``data`` mesh).
    :param dtypes: ``None``, one JAX dtype for every column, or a dict by column, as in
        ``iter_jax_batches``.
    :param convert_one_by_one: Ray's per-column converter; used for a batch the fast
        conversion does not take (text, a column missing from ``dtypes``), so the error is Ray's.
    """

    def __init__(self, sharding: Any, dtypes: Any, convert_one_by_one: Callable[..., dict[str, Any]]) -> None:
        import jax

        self._jax = jax
        self._sharding = sharding
        self._dtypes = dtypes
        self._one_by_one = convert_one_by_one
        self._processes = jax.process_count()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        if not self._convertible(batch):  # Ray's converter raises Ray's own error for it
            return self._one_by_one(batch, self._sharding, dtypes=self._dtypes)
        return self._convert(batch)

    def _convertible(self, batch: dict[str, np.ndarray]) -> bool:
        """Numbers and booleans only, and a (hashable) dtype for every column when ``dtypes`` is a dict."""
        if isinstance(self._dtypes, dict) and any(name not in self._dtypes for name in batch):
            return False
        if not all(isinstance(d, Hashable) for d in (self._dtypes.values() if isinstance(self._dtypes, dict)
                                                     else [self._dtypes])):
            return False  # the cached split function is looked up by dtype
        issubdtype = self._jax.numpy.issubdtype  # calls jax.dtypes.issubdtype, which jax.dtypes does not export
        return all(issubdtype(c.dtype, np.number) or c.dtype == np.bool_ for c in batch.values())

    def _convert(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        names = list(batch)
        casts = {name: _column_dtype(self._dtypes, name) for name in names}
        groups: dict[tuple[Any, ...], list[str]] = {}
        for name in names:
            column = batch[name]
            if column.nbytes <= STACK_MAX_BYTES and column.ndim >= 1 and _is_canonical(column.dtype):
                groups.setdefault((column.dtype, column.shape[1:]), []).append(name)
        stacks = [members for members in groups.values() if len(members) > 1]
        stacked = {name for members in stacks for name in members}

        host = [np.stack([batch[name] for name in members], axis=1) for members in stacks]
        alone = [name for name in names if name not in stacked]
        host += [batch[name] for name in alone]
        # Ray's global shape: each host contributes the same number of rows (jax_util.py,
        # _convert_ndarray_to_jax_array).
        shapes = [(a.shape[0] * self._processes,) + a.shape[1:] for a in host]
        arrays = self._jax.make_array_from_process_local_data(self._sharding, host, shapes)

        to_split = tuple(arrays[: len(stacks)])
        # arrays: one per stack, then one per column alone (host's order)
        to_cast = [(name, array) for name, array in zip(alone, arrays[len(stacks):], strict=True)
                   if casts[name] is not None]
        out = dict(zip(alone, arrays[len(stacks):], strict=True))
        if stacks or to_cast:
            split = _splitter(self._sharding, tuple(tuple(m) for m in stacks), tuple(name for name, _ in to_cast),
                              tuple(casts.items()))
            out.update(split(to_split, tuple(array for _, array in to_cast)))
        return {name: out[name] for name in names}


@functools.lru_cache(maxsize=64)
def _splitter(
    sharding: Any, stacks: tuple[tuple[str, ...], ...], cast_names: tuple[str, ...], casts: tuple[tuple[str, Any], ...]
) -> Any:
    """One jitted function: stacked arrays back to columns, and every ``dtypes`` cast.

    Cached across iterations (every epoch would otherwise compile it again).
    """
    import jax

    dtype_of = dict(casts)

    def split(stacked: tuple[Any, ...], to_cast: tuple[Any, ...]) -> dict[str, Any]:
        out = {}
        for members, array in zip(stacks, stacked, strict=True):
            for index, name in enumerate(members):
                out[name] = array[:, index]
        out.update(zip(cast_names, to_cast, strict=True))
        # Ray: physical_array.astype(dtype) when a dtype is given (jax_util.py).
        return {name: (a if dtype_of[name] is None else a.astype(dtype_of[name])) for name, a in out.items()}

    return jax.jit(split, out_shardings=sharding)


def _is_canonical(dtype: np.dtype) -> bool:
    """Whether JAX keeps this numpy dtype as it is (no float64 -> float32 when x64 is off)."""
    import jax

    return dtype != np.dtype(object) and jax.dtypes.canonicalize_dtype(dtype) == dtype
