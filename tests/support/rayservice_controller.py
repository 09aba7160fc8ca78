"""KubeRay's RayService controller, played step by step by the RayService tests.

tests/support/fake_apiserver has no RayService controller, so :class:`RayServiceController` plays its
part as KubeRay v1.5 does it: it creates the RayCluster from the service's
``rayClusterConfig`` (annotations copied, name ``<service>-<5 chars>``), first as the
pending cluster, and writes realistic statuses through ``KubeRayReactor.set_service_status``;
the reactor then runs that cluster's pods as usual. :func:`in_background` plays it while a DAG runs.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

from airflow_provider_raytpu.manifests.rayservice import service_version
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE


class RayServiceController:
    """KubeRay's RayService controller, played by the test for one service."""

    def __init__(self, kube: FakeKubeApiServer, kuberay: KubeRayReactor, name: str = "chat") -> None:
        self.kube, self.kuberay, self.name = kube, kuberay, name

    def service(self) -> dict[str, Any] | None:
        return self.kube.get_object("rayservices", NAMESPACE, self.name)

    def wait_for_version(self, version: str, timeout: float = 30) -> dict[str, Any]:
        return self.kube.wait_for(lambda: (s := self.service()) and service_version(s) == version and s, timeout)

    def make_cluster(self, suffix: str) -> str:
        """The RayCluster KubeRay creates: the service's rayClusterConfig, its labels and annotations."""
        service = self.service()
        assert service is not None
        name = f"{self.name}-{suffix}"
        self.kube.create_object({
            "apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {**service["metadata"]["labels"], "ray.io/originated-from-cr-name": self.name,
                                    "ray.io/originated-from-crd": "RayService"},
                         "annotations": dict(service["metadata"]["annotations"])},
            "spec": copy.deepcopy(service["spec"]["rayClusterConfig"]),
        })
        return name

    @staticmethod
    def app(status: str, message: str = "", **deployments: tuple[str, str]) -> dict[str, Any]:
        return {"chat": {"status": status, "message": message, "serveDeploymentStatuses": {
            name: {"status": s, "message": m} for name, (s, m) in deployments.items()}}}

    def initializing(self, cluster: str, status: str = "DEPLOYING", message: str = "", **deployments: Any) -> None:
        self.kuberay.set_service_status(
            self.name, NAMESPACE,
            conditions={"Ready": (False, "Initializing"), "UpgradeInProgress": (False, "Initializing")},
            pending=self.app(status, message, **deployments), pending_cluster=cluster)

    def upgrading(self, cluster: str, status: str = "DEPLOYING", message: str = "") -> None:
        self.kuberay.set_service_status(
            self.name, NAMESPACE, conditions={"Ready": True, "UpgradeInProgress": True},
            pending=self.app(status, message), pending_cluster=cluster)

    def serving(self, cluster: str, status: str = "RUNNING") -> None:
        """Promote ``cluster`` to active (or update the active one's applications)."""
        self.kuberay.set_service_status(
            self.name, NAMESPACE, conditions={"Ready": True, "UpgradeInProgress": False},
            active=self.app(status), active_cluster=cluster, pending={}, pending_cluster="", num_serve_endpoints=1)


@contextlib.contextmanager
def in_background(play: Callable[[], None]) -> Iterator[None]:
    """Run ``play`` (KubeRay's part) in a thread while the DAG runs; its errors fail the test."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            play()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    thread.join(30)
    if errors:
        raise errors[0]
