"""The Ray names this provider uses that Ray does not export publicly, looked up in this one place.

A Ray upgrade that moves one fails in ``tests/unit/test_compat.py``, not somewhere in a job. Each name is
imported only when it is first used (``from ...ray_compat import Batcher`` imports Ray's batcher then): the
local backend's supervisor takes ``GcsClient`` from here without importing Ray Data (4 s and 100 MB more per
process). The Airflow side has its own module for Airflow's names (:mod:`airflow_provider_raytpu.compat`):
workloads run on the cluster, where Airflow is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray._private.log import PlainRayHandler
    from ray.data._internal.batcher import Batcher
    from ray.data._internal.datasource.parquet_datasink import ParquetDatasink
    from ray.data._internal.execution.interfaces import TaskContext
    from ray.data.util import jax_util
    from ray.train.v2._internal.execution import context as train_context

    GcsClient: Any  # a Cython class of ray._raylet that Ray's stub (_raylet.pyi) leaves out

__all__ = ["PRIVATE_NAMES", "Batcher", "GcsClient", "ParquetDatasink", "PlainRayHandler", "TaskContext",
           "jax_util", "train_context"]

#: Each private name: the module it is in, and its name there (``None``: the module itself).
PRIVATE_NAMES: dict[str, tuple[str, str | None]] = {
    # Ray Data's own Parquet writer, subclassed to count the rows each write task took in (row_tally.py).
    "ParquetDatasink": ("ray.data._internal.datasource.parquet_datasink", "ParquetDatasink"),
    # The running write task's context, where that count is kept between blocks.
    "TaskContext": ("ray.data._internal.execution.interfaces", "TaskContext"),
    # What iter_batches re-batches blocks with; reused to slice blocks without a copy (block_batches.py).
    "Batcher": ("ray.data._internal.batcher", "Batcher"),
    # The console handler Ray Train gives the root logger, filtered of its per-report lines (session.py).
    "PlainRayHandler": ("ray._private.log", "PlainRayHandler"),
    # Ray Train v2's worker context module, whose logger writes those lines.
    "train_context": ("ray.train.v2._internal.execution", "context"),
    # Ray Data's JAX batch helpers: the 1-D sharding and the per-column converter of iter_jax_batches, whose
    # private names (_create_sharding_1d, _GLOBAL_MESH_1D_AXIS, _convert_batch) batch_transfer.py reuses.
    "jax_util": ("ray.data.util.jax_util", None),
    # The GCS client the local backend reads ALIVE nodes with: a Cython class Ray's _raylet stub leaves out.
    "GcsClient": ("ray._raylet", "GcsClient"),
}


def __getattr__(name: str) -> Any:
    """Import a private Ray name on first use.

    :raises AttributeError: for a name not listed in :data:`PRIVATE_NAMES`.
    :raises ImportError: when this Ray has no such module or name.
    """
    if name not in PRIVATE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = PRIVATE_NAMES[name]
    where = f"{module}.{attribute}" if attribute else module
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = None
    if attribute and found is not None:
        found = getattr(found, attribute, None)
    if found is None:
        raise ImportError(f"Ray {_ray_version()} has no {where}: the provider's {name} moved in this Ray; update "
                          "airflow_provider_raytpu/workloads/ray_compat.py", name=name)
    return found


def _ray_version() -> str:
    import ray

    return str(ray.__version__)
