"""Packaging: Airflow discovers the provider, its connection type and form fields; parsing stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import airflow
import jsonschema
import pytest

from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.get_provider_info import get_provider_info

AIRFLOW_DIR = Path(airflow.__file__).parent


def test_provider_info_matches_airflows_schemas() -> None:
    info = get_provider_info()
    jsonschema.validate(info, json.loads((AIRFLOW_DIR / "provider_info.schema.json").read_text()))
    yaml_schema = json.loads((AIRFLOW_DIR / "provider.yaml.schema.json").read_text())
    conn_schema = yaml_schema["properties"]["connection-types"]
    jsonschema.validate(info["connection-types"], conn_schema)


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_airflow_discovers_the_connection_type_declaratively() -> None:
    out = run_python(
        "import json, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "from airflow.providers_manager import ProvidersManager\n"
        "pm = ProvidersManager()\n"
        "hook = pm.hooks['raytpu']\n"
        "widgets = sorted(k for k in pm.connection_form_widgets if k.startswith('extra__raytpu__'))\n"
        "print(json.dumps({'providers': 'airflow-provider-raytpu' in pm.providers,\n"
        "  'hook': hook.hook_class_name, 'widgets': widgets, 'behaviour': pm.field_behaviours['raytpu']}))\n"
    )
    found = json.loads(out.strip().splitlines()[-1])
    assert found["providers"]
    assert found["hook"] == "airflow_provider_raytpu.hooks.raytpu.RayTpuHook"
    assert "extra__raytpu__backend" in found["widgets"] and "extra__raytpu__kubernetes_conn_id" in found["widgets"]
    assert "extra" in found["behaviour"]["hidden_fields"]


HEAVY = ("ray", "jax", "orbax", "kubernetes", "kubernetes_asyncio", "google.cloud.container_v1",
         "airflow.providers.google.cloud", "airflow.providers.cncf.kubernetes.hooks", "tensorstore", "pyarrow")


def test_importing_operators_and_sensors_imports_nothing_heavy() -> None:
    package = Path(__file__).parents[2] / "airflow_provider_raytpu"
    modules = sorted(
        "airflow_provider_raytpu." + ".".join(p.relative_to(package).with_suffix("").parts)
        for folder in ("operators", "sensors", "triggers")
        for p in (package / folder).glob("*.py")
        if p.name != "__init__.py"
    )
    assert "airflow_provider_raytpu.operators.raycluster" in modules
    out = run_python(
        "import sys, json\n"
        f"for m in {modules!r}: __import__(m)\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(heavy) and "
        "(m in heavy or m.startswith(tuple(h + '.' for h in heavy))))))\n"
    )
    assert json.loads(out.strip().splitlines()[-1]) == []


def settings(**extra: object) -> ConnectionSettings:
    return ConnectionSettings.from_extra("raytpu_default", extra)


def test_connection_settings() -> None:
    s = settings(backend="gke", project_id="p", location="us-east5", cluster="c", use_internal_ip="true",
                 impersonation_chain="a@p.iam.gserviceaccount.com, b@p.iam.gserviceaccount.com")
    assert s.use_internal_ip is True
    assert s.impersonation_chain == ["a@p.iam.gserviceaccount.com", "b@p.iam.gserviceaccount.com"]
    assert settings(backend="local").namespace == "default"
    assert settings(backend="local", chip_hour_prices={"v6e": {"spot": 1}}).chip_hour_prices == {"v6e": {"spot": 1.0}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({}, "extra.backend"),
        ({"backend": "k8s"}, "extra.backend"),
        ({"backend": "gke", "project_id": "p"}, "extra"),
        ({"backend": "kubernetes", "dashboard": "ingress"}, "extra.dashboard"),
        ({"backend": "kubernetes", "dashboard": "url"}, "extra.dashboard_url"),
        ({"backend": "kubernetes", "namespaces": "ml"}, "extra"),
        ({"backend": "local", "local_max_hosts": "many"}, "extra.local_max_hosts"),
        ({"backend": "local", "chip_hour_prices": {"v6e": 2.7}}, "extra.chip_hour_prices"),
        ({"backend": "kubernetes", "dashboard": "dns"}, "extra.dashboard"),
        ({"backend": "gke", "project_id": "p", "location": "l", "cluster": "c", "dashboard": "url",
          "dashboard_url": "http://ray.internal/{cluster_name}"}, "extra.dashboard_url"),
    ],
)
def test_bad_connection_settings_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        ConnectionSettings.from_extra("raytpu_default", extra)
    assert info.value.field == f"connection 'raytpu_default' {field}"


def test_the_ray_token_goes_over_plain_http_only_when_the_connection_opts_in() -> None:
    with pytest.raises(InvalidInputError) as info:
        ConnectionSettings.from_extra("raytpu_default", {"backend": "kubernetes", "dashboard": "dns"})
    assert str(info.value) == (
        "connection 'raytpu_default' extra.dashboard='dns': would send each cluster's Ray token over plain http, "
        "where anyone on the path reads it. Reach dashboards through the API server (dashboard 'proxy', the "
        "default) or an https dashboard_url; or, on a network you trust, set insecure_dashboard_http to true (or "
        "ray_auth to false)")
    for kept in ({"dashboard": "dns", "insecure_dashboard_http": "true"}, {"dashboard": "dns", "ray_auth": False},
                 {"dashboard": "url", "dashboard_url": "https://ray.example.com/{cluster_name}"}, {}):
        settings = ConnectionSettings.from_extra("raytpu_default", {"backend": "kubernetes", **kept})
        assert settings.backend == "kubernetes"
