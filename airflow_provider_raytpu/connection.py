"""The fields of a ``raytpu`` connection, read strictly from its extras."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.names import check_namespace, label_value_problem
from airflow_provider_raytpu.values import check_prices, parse_bool, parse_int

BACKENDS = ("local", "kubernetes", "gke")
DASHBOARD_ACCESS = ("proxy", "dns", "url")
DEFAULT_CONN_ID = "raytpu_default"

HOW_TO_CONNECT = (
    "Create it in the UI (type 'Ray on TPU') or through the environment, e.g. "
    "AIRFLOW_CONN_RAYTPU_DEFAULT='{\"conn_type\": \"raytpu\", \"extra\": {\"backend\": \"local\"}}' "
    "for the local emulator, "
    "'{\"conn_type\": \"raytpu\", \"extra\": {\"backend\": \"kubernetes\", \"kubernetes_conn_id\": "
    "\"kubernetes_default\", \"namespace\": \"ray\"}}' for a Kubernetes cluster, or "
    "'{\"conn_type\": \"raytpu\", \"extra\": {\"backend\": \"gke\", \"project_id\": \"my-project\", "
    "\"location\": \"us-east5\", \"cluster\": \"my-gke-cluster\"}}' for GKE"
)


@dataclass(frozen=True)
class ConnectionSettings:
    """A parsed ``raytpu`` connection.

    :param conn_id: the Airflow connection id.
    :param backend: ``local``, ``kubernetes`` or ``gke``.
    :param namespace: the default namespace for clusters.
    :param kubernetes_conn_id: the cncf-kubernetes connection (backend ``kubernetes``).
    :param gcp_conn_id: the Google Cloud connection (backend ``gke``).
    :param project_id: the GKE cluster's project.
    :param location: the GKE cluster's region or zone.
    :param cluster: the GKE cluster's name.
    :param use_internal_ip: reach the GKE control plane on its private endpoint.
    :param use_dns_endpoint: reach the GKE control plane on its DNS endpoint.
    :param impersonation_chain: service account(s) to impersonate on GKE.
    :param gke_api_endpoint: a GKE API endpoint other than container.googleapis.com.
    :param dashboard: how to reach Ray dashboards: ``proxy`` (API server service proxy),
        ``dns`` (in-cluster service DNS) or ``url`` (``dashboard_url``).
    :param dashboard_url: the dashboard URL template for ``dashboard=url``;
        ``{cluster_name}`` and ``{namespace}`` are filled in.
    :param local_home: the local backend's state directory (default ``$RAYTPU_HOME``).
    :param local_max_hosts: the largest slice the local backend emulates.
    :param confirm_with_ray: a cluster is READY only once Ray lists every TPU host with its chips and slice
        (and, on Kubernetes, GKE's TPU webhook mutated its pods); a task's ``confirm_with_ray`` overrides it.
        Off for clusters whose image serves no Ray dashboard State API.
    :param ray_auth: (kubernetes, gke) turn on Ray's token authentication (KubeRay's ``authOptions``,
        where the CRD and the cluster's Ray 2.52+ have it) and send each cluster's token, read from the
        Secret KubeRay makes for it, to its dashboard.
    :param insecure_dashboard_http: send each cluster's Ray token to its dashboard over plain http
        (``dashboard`` ``dns``, or an ``http://`` ``dashboard_url``); off, such a connection with
        ``ray_auth`` is refused: anyone on the path would read the token.
    :param chip_hour_prices: a price per chip-hour by TPU generation and capacity kind,
        ``{"v6e": {"on-demand": 2.7, "spot": 1.1}}``: teardowns estimate each cluster's cost with it
        (a ``DeleteRayClusterOperator``'s own ``chip_hour_prices`` wins). No price is built in.
    :param deployment: which Airflow deployment this is, recorded on every object and output its tasks make and
        part of their default names, so two deployments with the same DAG ids (staging and prod) sharing a
        namespace or a bucket never take each other's. Default: derived from the deployment's Execution API
        URL (:func:`~airflow_provider_raytpu.hooks.raytpu.default_deployment`).
    """

    conn_id: str
    backend: str
    namespace: str = "default"
    kubernetes_conn_id: str | None = None
    gcp_conn_id: str = "google_cloud_default"
    project_id: str | None = None
    location: str | None = None
    cluster: str | None = None
    use_internal_ip: bool = False
    use_dns_endpoint: bool = False
    impersonation_chain: str | list[str] | None = None
    gke_api_endpoint: str | None = None
    dashboard: str = "proxy"
    dashboard_url: str | None = None
    local_home: str | None = None
    local_max_hosts: int = 8
    confirm_with_ray: bool = True
    ray_auth: bool = True
    insecure_dashboard_http: bool = False
    chip_hour_prices: Mapping[str, Mapping[str, float]] | None = None
    deployment: str | None = None

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> ConnectionSettings:
        """Read and check a connection's extras; every error names the field and the fix.

        :param conn_id: the connection id, used in errors.
        :param extra: the connection's extra JSON as a dict.
        """
        fields = {f for f in cls.__dataclass_fields__ if f != "conn_id"}
        if unknown := sorted(set(extra) - fields):
            raise InvalidInputError(
                f"connection {conn_id!r} extra", unknown, "has unknown fields", f"Use only: {', '.join(sorted(fields))}"
            )
        backend = extra.get("backend")
        if backend not in BACKENDS:
            raise InvalidInputError(
                f"connection {conn_id!r} extra.backend", backend, "is not a backend", f"Set it to one of {BACKENDS}"
            )
        values = _typed_values(conn_id, extra)
        _check_dashboard_access(conn_id, backend, values)
        _check_names(conn_id, values)
        if backend == "gke":
            missing = [f for f in ("project_id", "location", "cluster") if not values.get(f)]
            if missing:
                raise InvalidInputError(
                    f"connection {conn_id!r} extra", missing, "are required for backend 'gke'",
                    "Set project_id, location and cluster (the GKE cluster's name)",
                )
        return cls(conn_id=conn_id, **values)


def _typed_values(conn_id: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The extras that are set, each as its field's type (a form sends every value as a string)."""
    values: dict[str, Any] = {k: v for k, v in extra.items() if v not in (None, "")}
    for flag in ("use_internal_ip", "use_dns_endpoint", "confirm_with_ray", "ray_auth",
                 "insecure_dashboard_http"):
        if flag in values:
            values[flag] = parse_bool(values[flag], f"connection {conn_id!r} extra.{flag}")
    if "local_max_hosts" in values:
        values["local_max_hosts"] = parse_int(values["local_max_hosts"],
                                              f"connection {conn_id!r} extra.local_max_hosts")
    chain = values.get("impersonation_chain")
    if isinstance(chain, str) and "," in chain:
        values["impersonation_chain"] = [account.strip() for account in chain.split(",") if account.strip()]
    if "chip_hour_prices" in values:
        values["chip_hour_prices"] = check_prices(values["chip_hour_prices"],
                                                  f"connection {conn_id!r} extra.chip_hour_prices")
    return values


def _check_dashboard_access(conn_id: str, backend: str, values: Mapping[str, Any]) -> None:
    if values.get("dashboard", "proxy") not in DASHBOARD_ACCESS:
        raise InvalidInputError(
            f"connection {conn_id!r} extra.dashboard", values["dashboard"], "is not a way to reach the dashboard",
            f"Set it to one of {DASHBOARD_ACCESS}",
        )
    if values.get("dashboard") == "url" and not values.get("dashboard_url"):
        raise InvalidInputError(
            f"connection {conn_id!r} extra.dashboard_url", None, "is required with dashboard='url'",
            "Set it, e.g. 'https://ray.example.com/{namespace}/{cluster_name}/'",
        )
    check_token_transport(conn_id, backend, values)


def _check_names(conn_id: str, values: Mapping[str, Any]) -> None:
    """The namespace and the deployment's name are valid Kubernetes names."""
    if "namespace" in values:
        check_namespace(values["namespace"], f"connection {conn_id!r} extra.namespace")
    if "deployment" in values and (problem := label_value_problem(values["deployment"])):
        raise InvalidInputError(f"connection {conn_id!r} extra.deployment", values["deployment"], problem,
                                "Name the deployment as a Kubernetes label value, e.g. 'prod' or 'staging'")


def check_token_transport(conn_id: str, backend: str, values: Mapping[str, Any]) -> None:
    """Refuse a connection that would send Ray tokens over plain http unless it opts in.

    :raises InvalidInputError: ``dashboard`` ``dns`` or an ``http://`` ``dashboard_url`` with ``ray_auth``.
    """
    dashboard = values.get("dashboard", "proxy")
    plain = dashboard == "dns" or (dashboard == "url" and str(values.get("dashboard_url")).startswith("http://"))
    if backend == "local" or not plain or not values.get("ray_auth", True):
        return
    if values.get("insecure_dashboard_http"):
        return
    shown = "dns" if dashboard == "dns" else values.get("dashboard_url")
    raise InvalidInputError(
        f"connection {conn_id!r} extra.{'dashboard' if dashboard == 'dns' else 'dashboard_url'}", shown,
        "would send each cluster's Ray token over plain http, where anyone on the path reads it",
        "Reach dashboards through the API server (dashboard 'proxy', the default) or an https dashboard_url; "
        "or, on a network you trust, set insecure_dashboard_http to true (or ray_auth to false)")
