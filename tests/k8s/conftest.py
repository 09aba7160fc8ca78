"""pytest wiring for the real Kubernetes control plane (see README.md).

Another test tree gets the same session fixture with::

    # tests/integration/conftest.py
    from tests.k8s.controlplane import k8s_control_plane  # noqa: F401  (session fixture)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.k8s.controlplane import ControlPlane, k8s_control_plane  # noqa: F401  (session fixture)


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so this directory works alone.
    config.addinivalue_line(
        "markers", "k8s: needs the real Kubernetes control plane binaries (tests/k8s/build_binaries.sh)")


@pytest.fixture(scope="module")
def head_nodes(k8s_control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """A CPU node for the Ray heads of one module (TPU nodes are tainted); removed after it."""
    pool = f"heads-{request.module.__name__.rsplit('.', 1)[-1].removeprefix('test_').replace('_', '-')}"
    nodes = k8s_control_plane.add_node_pool(pool, cpu_nodes=1)
    yield nodes
    k8s_control_plane.delete_node_pool(pool)
