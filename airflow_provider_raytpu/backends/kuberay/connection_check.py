"""What the connection's Test button finds on Kubernetes, a line each: GKE's TPU webhook and the verbs of
the provider's Role (``docs/rbac.yaml``) that the connection's identity lacks.

Neither stops the test: an identity bound to that Role alone may not list cluster-wide objects such
as webhook configurations, and says so ("cannot check"). Verbs are asked with one
``SelfSubjectAccessReview`` each, which every authorizer answers (RBAC, and GKE's IAM, which a
``SelfSubjectRulesReview`` cannot list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients

#: The provider's Role (docs/rbac.yaml): (API group, resource) -> verbs.
ROLE_VERBS: dict[tuple[str, str], tuple[str, ...]] = {
    ("ray.io", "rayclusters"): ("get", "list", "watch", "create", "update", "patch", "delete"),
    ("ray.io", "rayservices"): ("get", "list", "watch", "create", "update", "delete"),
    ("", "pods"): ("list",),
    ("", "events"): ("list",),
    ("", "services/proxy"): ("get", "create", "update"),
    ("", "secrets"): ("get",),
    ("kueue.x-k8s.io", "workloads"): ("list",),
    ("kueue.x-k8s.io", "localqueues"): ("get",),
}
WEBHOOK_FIX = ("on GKE, enable the Ray operator add-on (gcloud container clusters update CLUSTER "
               "--update-addons=RayOperator=ENABLED); elsewhere install ai-on-gke's kuberay-tpu-webhook")


def _denied(exc: ApiException) -> str:
    return f"cannot check: {exc.status} {exc.reason}"


def missing_verbs_line(clients: KubeClients, namespace: str) -> str:
    """Which verbs of the provider's Role the identity lacks in ``namespace``."""
    from kubernetes import client as k8s

    authorization = k8s.AuthorizationV1Api(clients.api_client)
    missing = []
    try:
        for (group, resource), verbs in ROLE_VERBS.items():
            kind, _, subresource = resource.partition("/")
            for verb in verbs:
                review = authorization.create_self_subject_access_review({
                    "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": {"namespace": namespace, "verb": verb, "group": group,
                                                    "resource": kind, "subresource": subresource}}})
                if not review.status.allowed:
                    missing.append(f"{verb} on {resource}{'.' + group if group else ''}")
    except ApiException as exc:
        return f"RBAC in namespace {namespace!r}: {_denied(exc)}"
    if not missing:
        return f"RBAC in namespace {namespace!r}: every verb of the provider's Role (docs/rbac.yaml) is granted"
    return (f"RBAC in namespace {namespace!r}: missing {', '.join(missing)} (grant the provider's Role, "
            "docs/rbac.yaml)")


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a Kubernetes label selector (``matchLabels``, ``matchExpressions``) selects ``labels``."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if not {"In": present and labels.get(key) in values, "NotIn": not present or labels[key] not in values,
                "Exists": present, "DoesNotExist": not present}.get(operator, False):
            return False
    return True


def _mutates_pods(webhook: Mapping[str, Any]) -> bool:
    return any("pods" in (rule.get("resources") or []) and {"CREATE", "*"} & set(rule.get("operations") or [])
               for rule in webhook.get("rules") or [])


def tpu_webhook_line(clients: KubeClients, namespace: str) -> str:
    """Whether a mutating webhook for TPU pods (GKE's, or ai-on-gke's kuberay-tpu-webhook) applies in ``namespace``."""
    from kubernetes import client as k8s

    try:
        configurations = k8s.AdmissionregistrationV1Api(clients.api_client).list_mutating_webhook_configuration()
    except ApiException as exc:
        return f"GKE TPU webhook: {_denied(exc)} (listing mutatingwebhookconfigurations is cluster-wide)"
    found = [(configuration.metadata.name, clients.api_client.sanitize_for_serialization(webhook))
             for configuration in configurations.items for webhook in configuration.webhooks or []
             if "tpu" in f"{configuration.metadata.name} {webhook.name}".lower()]
    found = [(name, webhook) for name, webhook in found if _mutates_pods(webhook)]
    if not found:
        return (f"GKE TPU webhook: none of the {len(configurations.items)} mutating webhook configurations "
                f"mutates TPU pods, so multi-host slices cannot start: {WEBHOOK_FIX}")
    names = ", ".join(sorted({name for name, _ in found}))
    try:
        labels = k8s.CoreV1Api(clients.api_client).read_namespace(namespace).metadata.labels or {}
    except ApiException as exc:
        return f"GKE TPU webhook: {names}; whether it applies in namespace {namespace!r}: {_denied(exc)}"
    if any(selects(webhook.get("namespaceSelector"), labels) for _, webhook in found):
        return f"GKE TPU webhook: {names} mutates the TPU pods of namespace {namespace!r}"
    return (f"GKE TPU webhook: {names} exists, but its namespaceSelector leaves out namespace {namespace!r} "
            f"(labels {dict(labels)}): multi-host slices there cannot start")
