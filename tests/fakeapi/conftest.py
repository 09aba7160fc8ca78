"""The fakeapi tier: hooks, operators and triggers against a Kubernetes API over real HTTP.

The API server is the stateful fake in tests/support/fake_apiserver (custom objects with status,
resourceVersion, watch with resume and 410) and a reactor playing KubeRay's status
updates; the official Kubernetes clients talk to it exactly as to a real one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE, raytpu_connection

if TYPE_CHECKING:
    from tests.support.rayservice_controller import RayServiceController

@pytest.fixture
def kube() -> FakeKubeApiServer:
    with FakeKubeApiServer() as server:
        yield server


@pytest.fixture
def kuberay(kube: FakeKubeApiServer) -> KubeRayReactor:
    with KubeRayReactor(kube, delay=0.1, stagger=0.01) as reactor:
        yield reactor


@pytest.fixture
def connections(kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``raytpu_default`` (backend kubernetes) -> ``kube_test`` (cncf-kubernetes kube_config) -> the fake server."""
    monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection(NAMESPACE))
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection())


@pytest.fixture
def backend(connections: None) -> KubeRayBackend:
    backend = RayTpuHook().backend
    assert isinstance(backend, KubeRayBackend)
    return backend


@pytest.fixture
def controller(kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> RayServiceController:
    """KubeRay's RayService controller for the service ``chat``, played by the test."""
    from tests.support.rayservice_controller import RayServiceController

    return RayServiceController(kube, kuberay)
