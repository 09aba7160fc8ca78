"""What the real API server checks and fills in on a write, before storing: type meta, names,
core-type defaults (pods, services, secrets) and CRD schema defaulting/pruning."""

from __future__ import annotations

import base64
import json
import re

from ._errors import ApiError
from ._resources import ResourceType

GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand
SYSTEM_META = ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
               "deletionGracePeriodSeconds", "generation", "selfLink")


def dns_subdomain_error(name: str) -> str | None:
    if len(name) > 253:
        return "must be no more than 253 characters"
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        return ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    return None


def check_type_meta(res: ResourceType, obj: dict) -> None:
    """``kind`` / ``apiVersion`` of a body must name the resource of the URL (custom resources: required)."""
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if res.custom and (not kind or not api_version):
        missing = "Kind" if not kind else "apiVersion"
        raise ApiError.bad_request(f"Object '{missing}' is missing in '{json.dumps(obj, separators=(',', ':'))}'")
    if api_version and api_version != res.api_version:
        raise ApiError.bad_request(
            f"the API version in the data ({api_version}) does not match the expected API version ({res.api_version})")
    if kind and kind != res.kind:
        raise ApiError.bad_request(f"the kind in the data ({kind}) does not match the expected kind ({res.kind})")
    obj["kind"], obj["apiVersion"] = res.kind, res.api_version


def qos_class(pod: dict) -> str:
    containers = (pod.get("spec") or {}).get("containers") or []
    any_set, guaranteed = False, bool(containers)
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for key in ("cpu", "memory"):
            limit = lim.get(key)
            if limit is None or str(req.get(key, limit)) != str(limit):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def fold_string_data(obj: dict) -> None:
    """A Secret's ``stringData`` goes into ``data``, base64-encoded."""
    string_data = obj.pop("stringData", None)
    if string_data:
        data = obj.setdefault("data", {})
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()


class CoreDefaults:
    """The bits of core-type defaulting our code can observe, with the cluster IPs services get."""

    def __init__(self) -> None:
        self._ip_counter = 10

    def _new_ip(self, prefix: str) -> str:
        self._ip_counter += 1
        return f"{prefix}.{self._ip_counter // 250}.{self._ip_counter % 250 + 2}"

    def apply(self, res: ResourceType, obj: dict) -> None:
        if res.plural == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("enableServiceLinks", True)
            for c in spec.get("containers") or []:
                c.setdefault("terminationMessagePath", "/dev/termination-log")
                c.setdefault("terminationMessagePolicy", "File")
                image = c.get("image", "")
                c.setdefault("imagePullPolicy",
                             "Always" if image.endswith(":latest") or ":" not in image else "IfNotPresent")
                c.setdefault("resources", {})
            obj["status"] = {"phase": "Pending", "qosClass": qos_class(obj)}
        elif res.plural == "services":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if not spec.get("clusterIP"):
                spec["clusterIP"] = self._new_ip("10.96")
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
            spec.setdefault("sessionAffinity", "None")
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
            spec.setdefault("internalTrafficPolicy", "Cluster")
            for p in spec.get("ports") or []:
                p.setdefault("protocol", "TCP")
                p.setdefault("targetPort", p.get("port"))
            obj["status"] = {"loadBalancer": {}}
        elif res.plural == "secrets":
            obj.setdefault("type", "Opaque")
            fold_string_data(obj)


def apply_schema(schema: dict | None, obj: dict, field_validation: str | None) -> list[str]:
    """Prune unknown fields and fill defaults of a custom resource; the ``Warning``s to send.
    ``fieldValidation=Strict`` turns a pruned field into 400."""
    if schema is None:
        return []
    from ._schema import apply_defaults, prune

    dropped = prune(schema, obj, root=True)
    if dropped and (field_validation or "").lower() == "strict":
        raise ApiError.bad_request(
            "strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in dropped))
    apply_defaults(schema, obj)
    return [f'unknown field "{p}"' for p in dropped] if (field_validation or "Warn").lower() == "warn" else []
