"""Provider metadata read by Airflow's providers manager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_provider_raytpu.version import __version__


def _field(label: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "description": description, "schema": schema}


_STRING = {"type": ["string", "null"]}
_FLAG = {"type": ["boolean", "null"]}

CONN_FIELDS = {
    "backend": _field(
        "Backend",
        "local: Ray on this machine with emulated TPU slices; kubernetes: KubeRay through a Kubernetes "
        "connection; gke: KubeRay on a GKE cluster through a Google Cloud connection.",
        {"type": "string", "enum": ["local", "kubernetes", "gke"], "default": "local"},
    ),
    "namespace": _field("Namespace", "Default namespace for RayClusters.", {**_STRING, "default": "default"}),
    "kubernetes_conn_id": _field(
        "Kubernetes connection", "cncf-kubernetes connection id (backend kubernetes).", _STRING
    ),
    "gcp_conn_id": _field("Google Cloud connection", "Google Cloud connection id (backend gke).", _STRING),
    "project_id": _field("GKE project", "Project of the GKE cluster (backend gke).", _STRING),
    "location": _field("GKE location", "Region or zone of the GKE cluster (backend gke).", _STRING),
    "cluster": _field("GKE cluster", "Name of the GKE cluster (backend gke).", _STRING),
    "use_internal_ip": _field("Use internal IP", "Reach the GKE control plane on its private endpoint.", _FLAG),
    "use_dns_endpoint": _field("Use DNS endpoint", "Reach the GKE control plane on its DNS endpoint.", _FLAG),
    "impersonation_chain": _field(
        "Impersonation chain", "Service account(s) to impersonate on GKE, comma separated.", _STRING
    ),
    "gke_api_endpoint": _field("GKE API endpoint", "A GKE API endpoint other than the default.", _STRING),
    "dashboard": _field(
        "Dashboard access",
        "How to reach Ray dashboards: proxy (API server service proxy), dns (in-cluster DNS) or url.",
        {"type": ["string", "null"], "enum": ["proxy", "dns", "url", None], "default": "proxy"},
    ),
    "dashboard_url": _field(
        "Dashboard URL", "For dashboard=url; {cluster_name} and {namespace} are filled in.", _STRING
    ),
    "confirm_with_ray": _field(
        "Confirm with Ray",
        "A cluster is ready only once Ray lists every TPU host with its chips and slice (and GKE's TPU "
        "webhook mutated its pods). Turn off for images without Ray's dashboard.",
        {**_FLAG, "default": True},
    ),
    "ray_auth": _field(
        "Ray token authentication",
        "Backends kubernetes and gke: turn on Ray's token authentication (KubeRay authOptions, Ray 2.52+) and "
        "send each cluster's token, read from its Secret (needs get on secrets).",
        {**_FLAG, "default": True},
    ),
    "insecure_dashboard_http": _field(
        "Ray token over plain http",
        "Send each cluster's Ray token over plain http (dashboard dns, or an http:// dashboard URL); without it "
        "such a connection is refused. Only on a network you trust.",
        {**_FLAG, "default": False},
    ),
    "chip_hour_prices": _field(
        "Chip-hour prices",
        'For teardowns\' cost estimates: a price per chip-hour by TPU generation and capacity kind, e.g. '
        '{"v6e": {"on-demand": 2.7, "spot": 1.1}}. No price is built in.',
        {"type": ["object", "null"]},
    ),
    "deployment": _field(
        "Airflow deployment",
        "This deployment's name (e.g. prod, staging), recorded on every object and output its tasks make, so two "
        "deployments with the same DAG ids sharing a namespace or bucket never take each other's. Default: "
        "derived from the Execution API URL.",
        _STRING,
    ),
    "local_home": _field("Local state directory", "Backend local: where clusters are recorded.", _STRING),
    "local_max_hosts": _field(
        "Local host limit", "Backend local: the largest slice emulated, in hosts.", {"type": ["integer", "null"]}
    ),
}


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-raytpu",
        "name": "Ray on TPU",
        "description": "Topology-aware Ray clusters, jobs, training and serving on Google TPU slices.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Ray on TPU",
                "external-doc-url": "https://docs.ray.io/en/latest/cluster/kubernetes/user-guides/tpu.html",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Ray on TPU",
                "python-modules": [
                    "airflow_provider_raytpu.operators.raycluster",
                    "airflow_provider_raytpu.operators.ray_job",
                    "airflow_provider_raytpu.operators.ray_data",
                    "airflow_provider_raytpu.operators.jax_trainer",
                    "airflow_provider_raytpu.operators.rayservice",
                    "airflow_provider_raytpu.operators.run_report",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": "Ray on TPU",
                "python-modules": [
                    "airflow_provider_raytpu.sensors.raycluster",
                    "airflow_provider_raytpu.sensors.rayservice",
                ],
            }
        ],
        "hooks": [
            {
                "integration-name": "Ray on TPU",
                "python-modules": ["airflow_provider_raytpu.hooks.raytpu", "airflow_provider_raytpu.hooks.ray_jobs"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Ray on TPU",
                "python-modules": [
                    "airflow_provider_raytpu.triggers.raycluster",
                    "airflow_provider_raytpu.triggers.ray_job",
                    "airflow_provider_raytpu.triggers.rayservice",
                ],
            }
        ],
        "connection-types": [
            {
                "connection-type": "raytpu",
                "hook-class-name": "airflow_provider_raytpu.hooks.raytpu.RayTpuHook",
                "hook-name": "Ray on TPU",
                "conn-fields": CONN_FIELDS,
                "ui-field-behaviour": {
                    "hidden-fields": ["host", "schema", "login", "password", "port", "extra"],
                },
            }
        ],
    }
