"""Pytest fixtures for the fake Kubernetes API server; import them into a test module or conftest:

    from tests.support.fake_apiserver.fixtures import fake_kube, fake_kuberay, kube_api, akube_api  # noqa: F401
"""

from __future__ import annotations

import pytest

from .kuberay import KubeRayReactor
from .server import FakeKubeApiServer


@pytest.fixture
def fake_kube():
    """A started FakeKubeApiServer (fresh state per test)."""
    with FakeKubeApiServer() as server:
        yield server


@pytest.fixture
def fake_kuberay(fake_kube):
    """A KubeRayReactor on ``fake_kube``: pods become ready 0.1 s after creation, 10 ms apart."""
    with KubeRayReactor(fake_kube, delay=0.1, stagger=0.01) as reactor:
        yield reactor


@pytest.fixture
def kube_api(fake_kube):
    """A ``kubernetes.client.ApiClient`` configured from the fake server's kubeconfig."""
    from kubernetes import config

    api_client = config.new_client_from_config_dict(fake_kube.kubeconfig_dict())
    yield api_client
    api_client.close()


@pytest.fixture
async def akube_api(fake_kube):
    """A ``kubernetes_asyncio.client.ApiClient`` configured from the fake server's kubeconfig."""
    from kubernetes_asyncio import config

    api_client = await config.new_client_from_config_dict(fake_kube.kubeconfig_dict())
    yield api_client
    await api_client.close()
