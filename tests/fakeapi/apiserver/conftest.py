"""The fixtures of the fake's own tests: the server, a reactor and the official clients on it
(from fixtures.py), under the short names the tests use."""

from __future__ import annotations

import pytest
from kubernetes import client as kclient

from tests.support.fake_apiserver.fixtures import akube_api, fake_kube, fake_kuberay, kube_api  # noqa: F401 (fixtures)


@pytest.fixture
def server(fake_kube):
    return fake_kube


@pytest.fixture
def api(kube_api):
    return kube_api


@pytest.fixture
def custom(api):
    return kclient.CustomObjectsApi(api)


@pytest.fixture
def core(api):
    return kclient.CoreV1Api(api)


@pytest.fixture
def aapi(akube_api):
    return akube_api


@pytest.fixture
def reactor(fake_kuberay):
    return fake_kuberay
