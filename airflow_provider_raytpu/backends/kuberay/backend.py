"""RayClusters on Kubernetes (any kubeconfig) or GKE, through the KubeRay operator.

All Kubernetes access goes through the cncf-kubernetes hooks (backend ``kubernetes``)
or the Google provider's GKE hooks (backend ``gke``) (:mod:`.clients`), so every auth
method they support works here and no credential handling is written twice. The pieces:
custom objects (:mod:`.objects`), the event loop's shared async client (:mod:`.shared_client`),
informers (:mod:`.informer`, over :mod:`.watch`), batched pod reads (:mod:`.pods`), pods and
events for diagnosis (:mod:`.diagnosis`), the dashboard and Serve transports (:mod:`.transport`)
and RayServices (:mod:`.services`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from airflow_provider_raytpu.backends.apply import CLUSTER_OWNER, OnChange, apply_object, same_spec
from airflow_provider_raytpu.backends.base import ApplyResult, ClusterBackend, Precondition
from airflow_provider_raytpu.backends.kuberay.clients import KubeClients
from airflow_provider_raytpu.backends.kuberay.connection_check import missing_verbs_line, tpu_webhook_line
from airflow_provider_raytpu.backends.kuberay.crd import RayClusterCrd, read_raycluster_crd
from airflow_provider_raytpu.backends.kuberay.diagnosis import cluster_pods, diagnose_on_kubernetes
from airflow_provider_raytpu.backends.kuberay.informer import informer
from airflow_provider_raytpu.backends.kuberay.kueue import akueue_record, kueue_record
from airflow_provider_raytpu.backends.kuberay.objects import RAY_CLUSTERS, CustomObjects
from airflow_provider_raytpu.backends.kuberay.pods import pod_reader
from airflow_provider_raytpu.backends.kuberay.ray_token import RayTokenTransport, add_token_auth
from airflow_provider_raytpu.backends.kuberay.services import KubeRayServices
from airflow_provider_raytpu.backends.kuberay.transport import reach
from airflow_provider_raytpu.dashboard.nodes import aconfirm, confirm
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.manifests.raycluster import DASHBOARD_PORT, MANAGED_BY, MANAGED_BY_LABEL
from airflow_provider_raytpu.status import ClusterStatus, Phase, read_ray_cluster
from airflow_provider_raytpu.status.kueue import held_in
from airflow_provider_raytpu.status.tpu_webhook import check_tpu_webhook

if TYPE_CHECKING:
    from airflow_provider_raytpu.connection import ConnectionSettings
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

log = logging.getLogger(__name__)


class KubeRayBackend(ClusterBackend):
    """RayClusters and RayServices as KubeRay custom resources.

    Its RayServices (:attr:`services`) are :class:`~airflow_provider_raytpu.backends.kuberay.services.KubeRayServices`.

    :param settings: the parsed ``raytpu`` connection (backend ``kubernetes`` or ``gke``).
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        super().__init__(settings)
        self.clients = KubeClients(settings)
        self.objects = CustomObjects(self.clients, RAY_CLUSTERS)
        self.services = KubeRayServices(self, self.clients, self.objects, self.with_token_auth)
        self._dashboards: dict[tuple[str, str], HttpTransport] = {}

    def check(self) -> str:
        try:
            ours = self.list_clusters(self.namespace, f"{MANAGED_BY_LABEL}={MANAGED_BY}")
        except ApiException as exc:
            if exc.status == 404:
                raise FatalError(
                    "The Kubernetes API server has no rayclusters.ray.io: install the KubeRay operator "
                    "(on GKE, enable the Ray operator add-on)"
                ) from exc
            raise
        return "\n".join((
            f"Reached {self.clients.api_client.configuration.host}: RayClusters can be listed in namespace "
            f"{self.namespace!r} ({len(ours)} made by this provider)",
            self.raycluster_crd.describe(),
            tpu_webhook_line(self.clients, self.namespace),
            missing_verbs_line(self.clients, self.namespace),
        ))

    # -- RayCluster CRUD -------------------------------------------------------------------

    @functools.cached_property
    def raycluster_crd(self) -> RayClusterCrd:
        """The RayCluster CRD this cluster serves: which KubeRay features it has (read once per backend)."""
        return read_raycluster_crd(self.clients)

    def apply_cluster(self, manifest: dict[str, Any], *, update_if_exists: bool = False) -> ApplyResult:
        """As :meth:`ClusterBackend.apply_cluster`; where the CRD has ``upgradeStrategy`` (KubeRay 1.6 and
        newer) our own cluster with another spec is updated in place with ``Recreate`` (KubeRay replaces
        every pod; the object keeps its uid), elsewhere deleted, waited for and created again. Ray's token
        authentication is turned on where KubeRay and the Ray version have it (:meth:`with_token_auth`)."""
        def apply(manifest: dict[str, Any]) -> ApplyResult:
            if update_if_exists and self.raycluster_crd.upgrade_strategy:
                recreating = {**manifest, "spec": {**manifest["spec"], "upgradeStrategy": {"type": "Recreate"}}}
                return apply_object(self.objects, recreating, same=same_spec, owner=CLUSTER_OWNER,
                                    on_change=OnChange.REPLACE)
            return apply_object(self.objects, manifest, same=same_spec, owner=CLUSTER_OWNER,
                                on_change=OnChange.RECREATE if update_if_exists else OnChange.FAIL)

        return self.with_token_auth(apply, manifest, lambda cluster: cluster["spec"])

    def with_token_auth(self, apply: Callable[[dict[str, Any]], ApplyResult], manifest: dict[str, Any],
                        spec_of: Callable[[dict[str, Any]], dict[str, Any]]) -> ApplyResult:
        """``apply(manifest)`` with KubeRay's ``authOptions.mode: token`` in its RayCluster spec (``spec_of``
        finds it: the manifest's, or a RayService's ``rayClusterConfig``) where the connection's
        ``ray_auth`` is on and the cluster's Ray has token authentication
        (:mod:`~airflow_provider_raytpu.backends.kuberay.ray_token`). Where the CRD cannot be read, it is
        tried, and a KubeRay that does not know the field (older than 1.5.1) gets the manifest without it."""
        crd = self.raycluster_crd
        if not self.settings.ray_auth or not (crd.auth_options or crd.readable is False):
            return apply(manifest)
        authenticated = copy.deepcopy(manifest)
        add_token_auth(spec_of(authenticated))
        try:
            return apply(authenticated)
        except FatalError as exc:
            if crd.auth_options or "authOptions" not in str(exc):
                raise
            log.warning("This KubeRay does not know spec.authOptions (%s): the cluster runs without Ray's token "
                        "authentication; update KubeRay to 1.5.1 or newer", exc)
            return apply(manifest)

    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.objects.get(name, namespace)

    def delete_cluster(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        return self.objects.delete(name, namespace, precondition)

    def annotate_cluster(self, name: str, namespace: str, annotations: dict[str, str]) -> None:
        self.objects.annotate(name, namespace, annotations)

    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        return self.objects.list(namespace, label_selector)

    # -- status ----------------------------------------------------------------------------

    def cluster_pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        """The pods KubeRay made for the RayCluster."""
        return cluster_pods(self.clients, name, namespace)

    def cluster_status(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> ClusterStatus:
        """As :meth:`ClusterBackend.cluster_status`; with ``confirm_with_ray``, TPU pods the GKE TPU webhook did
        not mutate are FAILED at once (:mod:`~airflow_provider_raytpu.status.tpu_webhook`)."""
        cluster = self.get_cluster(name, namespace)
        if cluster is None:
            return read_ray_cluster(None)
        pods = self.cluster_pods(name, namespace)
        status = read_ray_cluster(cluster, pods)
        if (queue := held_in(cluster, status)) is not None:
            return kueue_record(self.clients, cluster, queue).held(status)
        if not confirm_with_ray:
            return status
        return confirm(check_tpu_webhook(status, cluster, pods), pods, self.dashboard(name, namespace))

    def diagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        cluster = self.get_cluster(name, namespace)
        if not confirm_with_ray:
            return diagnose_on_kubernetes(self.clients, cluster)
        return diagnose_on_kubernetes(self.clients, cluster, lambda status, pods: confirm(
            check_tpu_webhook(status, cluster, pods), pods, self.dashboard(name, namespace)))

    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The head service's ``dashboard`` port (``<name>-head-svc``), with the cluster's Ray token where it
        has one (:class:`~airflow_provider_raytpu.backends.kuberay.ray_token.RayTokenTransport`).

        One per cluster for the backend's life, so its token is read once (again when Ray refuses it): the
        triggers that follow jobs on a cluster cost one API request per tick between them, the job list.
        """
        found = self._dashboards.get((name, namespace))
        return found if found is not None else self._dashboards.setdefault(
            (name, namespace), self._new_dashboard(name, namespace))

    def _new_dashboard(self, name: str, namespace: str) -> HttpTransport:
        if self.settings.dashboard == "url":
            direct = (self.settings.dashboard_url or "").format(cluster_name=name, namespace=namespace)
        else:
            direct = f"http://{name}-head-svc.{namespace}.svc.cluster.local:{DASHBOARD_PORT}"
        transport = reach(self.settings, self.clients, namespace, f"{name}-head-svc", "dashboard", direct)
        if not self.settings.ray_auth:
            return transport
        return RayTokenTransport(transport, self.objects, name, namespace)

    async def watch_cluster(self, name: str, namespace: str, poll_interval: float = 10.0, *,
                            confirm_with_ray: bool = False) -> AsyncGenerator[ClusterStatus, None]:
        """The RayCluster's status now and after every change, from the event loop's informer of
        RayClusters in ``namespace`` (:mod:`~airflow_provider_raytpu.backends.kuberay.informer`).

        The status is read from the object; a READY is confirmed with the cluster's pods (every
        host of every slice ready, read together with other clusters' triggers of the same
        moment), with ``confirm_with_ray`` also with the TPU webhook's variables in those pods
        and Ray's node list, and, when they disagree, read again after ``poll_interval`` seconds
        or the next change, whichever comes first. A cluster Kueue holds is read with its Workload
        (:mod:`~airflow_provider_raytpu.status.kueue`), again every ``poll_interval`` seconds: the
        Workload changes while the cluster does not.
        """
        shared = await self.clients.shared()
        clusters = await informer(shared, self.objects, namespace)
        pods = await pod_reader(shared, self.settings.conn_id, namespace)
        async with clusters.subscribe(name, poll_interval) as subscription:
            cluster: dict[str, Any] | None = await subscription.next()
            while True:
                status = read_ray_cluster(cluster)
                again = False  # look again after poll_interval even without a change
                if cluster is not None and (queue := held_in(cluster, status)) is not None:
                    status, again = (await akueue_record(shared, cluster, queue)).held(status), True
                elif status.phase is Phase.READY:
                    try:
                        found = await pods.pods_of(name)
                    except Exception as exc:  # READY is not said without the pods; look again soon
                        log.warning("Reading the pods of RayCluster %s/%s failed: %s", namespace, name, exc)
                        status = dataclasses.replace(status, phase=Phase.PROVISIONING,
                                                     message=f"{status.message}; confirming with its pods")
                    else:
                        status = read_ray_cluster(cluster, found)
                        if confirm_with_ray:
                            status = await aconfirm(check_tpu_webhook(status, cluster, found), found,
                                                    self.dashboard(name, namespace))
                    again = status.phase is Phase.PROVISIONING  # the pods disagree
                if not again:
                    cluster = None  # a thousand waiting triggers keep no object each
                yield status
                if not again:
                    cluster = await subscription.next()
                    continue
                with contextlib.suppress(TimeoutError):
                    cluster = await asyncio.wait_for(subscription.next(), poll_interval)

    async def adiagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        return await asyncio.to_thread(functools.partial(self.diagnose_cluster, confirm_with_ray=confirm_with_ray),
                                       name, namespace)

    def close(self) -> None:
        self.clients.close()
