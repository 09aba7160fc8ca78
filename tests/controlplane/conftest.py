"""pytest wiring for the real Kubernetes control plane (see README.md): the session's control
plane, and the per-test and per-module setup every integration module shares.

Another test tree gets the same session fixture with::

    # tests/integration/conftest.py
    from tests.controlplane.session import k8s_control_plane  # noqa: F401  (session fixture)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest

from example_dags.demo.fake_gcs import FakeGcsServer
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.example_runs import BUCKET, EXAMPLES, LINEAGE_EVENTS, ROWS
from tests.controlplane.session import k8s_control_plane  # noqa: F401  (session fixture)
from tests.controlplane.support import Connections, NodePools, force_delete_clusters, suffix

os.environ.update({
    "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(LINEAGE_EVENTS),
                                                   "append": True}),
    "AIRFLOW__OPENLINEAGE__NAMESPACE": "raytpu-k8s",
    "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",
})


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so this directory works alone.
    config.addinivalue_line(
        "markers", "k8s: needs the real Kubernetes control plane binaries (tests/controlplane/build_binaries.sh)")
    config.addinivalue_line("markers", "after_the_tier: reads what every other test of the tier did; runs last")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("after_the_tier") is not None)  # stable: the rest keep order


def _module_slug(request: pytest.FixtureRequest) -> str:
    """``test_ray_head`` -> ``ray-head``: names what a module made."""
    return request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")


@pytest.fixture
def namespace(k8s_control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (``<module>-<6 hex>``) for one test; the RayClusters left in it are deleted after."""
    ns = k8s_control_plane.create_namespace(f"{_module_slug(request)}-{suffix()}")
    yield ns
    force_delete_clusters(k8s_control_plane, ns)


@pytest.fixture
def connections(k8s_control_plane: ControlPlane, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Connections:
    """Points the test's ``raytpu_default`` connection at its namespace, as the identity the test chooses."""
    return Connections(k8s_control_plane, namespace, monkeypatch)


@pytest.fixture
def admin_connections(connections: Connections) -> Connections:
    """``raytpu_default`` -> the test's namespace, with the admin identity."""
    connections.as_admin()
    return connections


@pytest.fixture
def node_pools(k8s_control_plane: ControlPlane) -> Iterator[NodePools]:
    """Node pools one test adds; deleted after it."""
    pools = NodePools(k8s_control_plane)
    yield pools
    pools.delete_all()


@pytest.fixture(scope="module")
def module_node_pools(k8s_control_plane: ControlPlane) -> Iterator[NodePools]:
    """Node pools one module adds; deleted after it."""
    pools = NodePools(k8s_control_plane)
    yield pools
    pools.delete_all()


@pytest.fixture(scope="module")
def head_nodes(module_node_pools: NodePools, request: pytest.FixtureRequest) -> list[str]:
    """A CPU node for the Ray heads of one module (TPU nodes are tainted); removed after it."""
    return module_node_pools.add(f"heads-{_module_slug(request)}", cpu_nodes=1).nodes


@pytest.fixture(scope="module")
def networked_control_plane(k8s_control_plane: ControlPlane) -> ControlPlane:
    """The control plane, when its pods can have networks of their own (else the module skips): the hosts
    of one slice run their raylets side by side."""
    if k8s_control_plane.pod_network is None:
        pytest.skip(f"pods cannot get a network of their own ({k8s_control_plane.pod_network_problem}), so "
                    "only one real Ray pod can run at a time: single-head mode (test_ray_head.py)")
    return k8s_control_plane


@pytest.fixture(scope="module")
def gcs(networked_control_plane: ControlPlane) -> Iterator[FakeGcsServer]:
    """The demo's fake GCS on the pod network's gateway (pods reach it there), with the raw data."""
    cp = networked_control_plane
    assert cp.pod_network is not None
    patch = pytest.MonkeyPatch()
    with FakeGcsServer(host=cp.pod_network.gateway) as server:
        server.create_bucket(BUCKET)
        for key, value in server.airflow_env().items():  # this process, and every pod started from now on
            patch.setenv(key, value)
        sys.path.insert(0, str(EXAMPLES))
        from pipeline.data import write_dataset

        write_dataset(f"gs://{BUCKET}/raw/rows.jsonl", ROWS, seed=7)
        yield server
        patch.undo()
