"""Which RayClusters get Ray's token authentication, and where their token is, as KubeRay v1.6.2 decides it."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay.ray_token import add_token_auth, check_name, token_secret
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice


@pytest.mark.parametrize(("ray_version", "auth_options"), [
    ("2.60.0", {"mode": "token"}), ("2.52.0", {"mode": "token"}), ("3.0.0", {"mode": "token"}),
    # KubeRay refuses authOptions.mode token below Ray 2.52 (utils/validation.go), and a version it cannot read.
    ("2.51.1", None), ("2.9.3", None), ("nightly", None)])
def test_token_auth_is_added_where_the_clusters_ray_has_it(ray_version: str, auth_options: Any) -> None:
    manifest = build_ray_cluster(name="c", namespace="ml", tpu=TpuSlice("v6e", "2x2"),
                                 options=RayClusterOptions(ray_version=ray_version))
    add_token_auth(manifest["spec"])
    assert manifest["spec"].get("authOptions") == auth_options


def test_a_clusters_own_auth_options_are_kept() -> None:
    spec: dict[str, Any] = {"rayVersion": "2.60.0", "authOptions": {"mode": "disabled"}}
    add_token_auth(spec)
    assert spec["authOptions"] == {"mode": "disabled"}


def cluster(name: str, auth: dict[str, Any] | None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {} if auth is None else {"authOptions": auth}}


@pytest.mark.parametrize(("auth", "secret"), [
    ({"mode": "token"}, "nightly"),
    ({"mode": "token", "secretName": "team-token"}, "team-token"),
    # Ray validates Kubernetes service-account tokens then: there is no Secret to read.
    ({"mode": "token", "enableK8sTokenAuth": True}, None),
    ({"mode": "disabled"}, None), ({}, None), (None, None)])
def test_the_secret_of_a_clusters_token(auth: dict[str, Any] | None, secret: str | None) -> None:
    assert token_secret(cluster("nightly", auth)) == secret


@pytest.mark.parametrize(("name", "checked"), [
    ("nightly", "nightly"), ("a" * 50, "a" * 50), ("x" * 3 + "b" * 50, "b" * 50),
    ("1abc", "rabc"), ("-abc", "rabc"), ("xxx7" + "d" * 49, "r" + "d" * 49)])
def test_secret_names_are_kuberays_check_name(name: str, checked: str) -> None:
    """utils.CheckName: the last 50 characters; a leading digit or punctuation becomes 'r'."""
    assert check_name(name) == checked
