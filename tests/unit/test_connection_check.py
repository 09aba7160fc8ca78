"""The connection test's pure parts: the verbs it asks for are docs/rbac.yaml's, and label selectors read as
Kubernetes reads them (a webhook's namespaceSelector)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from airflow_provider_raytpu.backends.kuberay.connection_check import ROLE_VERBS, selects

RBAC_YAML = Path(__file__).parents[2] / "docs" / "rbac.yaml"


def test_the_verbs_checked_are_the_documented_roles() -> None:
    role = yaml.safe_load(RBAC_YAML.read_text())
    documented = {(group, resource): tuple(rule["verbs"])
                  for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert documented == ROLE_VERBS


GKE_LIKE = {"matchLabels": {"tpu": "enabled"},
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                  "values": ["kube-system", "kube-node-lease"]}]}


@pytest.mark.parametrize(("selector", "labels", "selected"), [
    (None, {}, True),
    ({}, {"a": "b"}, True),
    (GKE_LIKE, {"tpu": "enabled", "kubernetes.io/metadata.name": "ml"}, True),
    (GKE_LIKE, {"kubernetes.io/metadata.name": "ml"}, False),
    (GKE_LIKE, {"tpu": "enabled", "kubernetes.io/metadata.name": "kube-system"}, False),
    ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml", "data"]}]}, {"team": "data"}, True),
    ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]}, {}, False),
    ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["ml"]}]}, {}, True),
    ({"matchExpressions": [{"key": "team", "operator": "Exists"}]}, {"team": ""}, True),
    ({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}, {"team": "ml"}, False),
])
def test_label_selectors_select_as_kubernetes_does(selector: dict | None, labels: dict, selected: bool) -> None:
    assert selects(selector, labels) is selected
