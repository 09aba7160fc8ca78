"""Kubernetes names and label values made from Airflow identifiers, and the label and annotation keys a user may
not set (this provider's and KubeRay's)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from airflow_provider_raytpu.errors import InvalidInputError

KEY_PREFIX = "raytpu.dev/"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "airflow-provider-raytpu"
KUBERAY_KEY_PREFIX = "ray.io/"
RAY_CLUSTER_NAME_LIMIT = 53
RAY_SERVICE_NAME_LIMIT = 47
LABEL_VALUE_LIMIT = 63

_NAME_RULE = (
    "a Kubernetes name has lower-case letters, digits and '-', starts and ends with a letter "
    "or digit, and has at most {limit} characters ('_', '.' and upper case are rewritten for you)"
)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def resource_name(value: str, field: str, limit: int = RAY_CLUSTER_NAME_LIMIT) -> str:
    """Normalise a rendered name into an RFC 1123 label of at most ``limit`` characters.

    Upper case becomes lower case and ``_``/``.``/spaces become ``-`` (DAG ids contain
    ``_``); a name that is too long keeps its start and gets a hash of the whole, so it
    stays unique and the same on every retry. Anything else is rejected with the rule.

    :param value: the name as rendered.
    :param field: the parameter name used in errors.
    :param limit: the maximum length (KubeRay: 53 for RayCluster, 47 for RayService).
    """
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(field, value, "is empty", "Give a name such as 'nightly-embeddings'")
    name = re.sub(r"[_.\s]+", "-", value.strip().lower())
    if bad := sorted(set(re.sub(r"[a-z0-9-]", "", name))):
        raise InvalidInputError(
            field,
            value,
            f"contains {''.join(bad)!r}, which a Kubernetes name cannot",
            "Rename it: " + _NAME_RULE.format(limit=limit),
        )
    name = name.strip("-")
    if not name:
        raise InvalidInputError(field, value, "has no letter or digit", _NAME_RULE.format(limit=limit))
    if len(name) > limit:
        name = f"{name[: limit - 9].rstrip('-')}-{_short_hash(value)}"
    return name


def owned_name(readable: str, identity: Sequence[object], field: str, limit: int = RAY_CLUSTER_NAME_LIMIT) -> str:
    """A default name: a readable prefix and a hash of everything that makes it unique.

    The hash covers ``identity`` exactly as given (``etl_daily`` and ``etl.daily`` hash
    apart although both read ``etl-daily``), so the name is the same on every retry and
    differs for every other identity, however long the readable part was.

    :param readable: what the name should say, e.g. the DAG id and task id; shortened to fit.
    :param identity: the values the name stands for, e.g. (DAG id, run id, task id, map index).
    :param field: the parameter name used in errors.
    :param limit: the maximum length.
    """
    digest = hashlib.sha256(json.dumps(list(identity), default=str).encode()).hexdigest()[:10]
    prefix = re.sub(r"[^a-z0-9]+", "-", readable.lower()).strip("-")
    if not prefix[:1].isalpha():  # KubeRay's <name>-head-svc must be a DNS-1035 label: a letter first
        prefix = f"ray-{prefix}".rstrip("-")
    return resource_name(f"{prefix[: limit - len(digest) - 1].rstrip('-')}-{digest}", field, limit)


def label_value(value: str) -> str:
    """A label value that carries an Airflow id (run ids contain ``:`` and ``+``).

    The exact id is kept in an annotation; the label is for selection only.
    """
    text = re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-_.")
    if len(text) > LABEL_VALUE_LIMIT:
        text = f"{text[: LABEL_VALUE_LIMIT - 9].rstrip('-_.')}-{_short_hash(value)}"
    return text


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def _short_name(value: object, field: str, rule: re.Pattern[str], what: str, fix: str) -> str:
    if not isinstance(value, str) or len(value) > LABEL_VALUE_LIMIT or not rule.fullmatch(value):
        raise InvalidInputError(field, value, f"is not {what}", fix)
    return value


def check_namespace(value: object, field: str = "namespace") -> str:
    """A namespace as Kubernetes requires it (an RFC 1123 label), before it goes into any URL path.

    :raises InvalidInputError: naming the field, the value and the rule.
    """
    return _short_name(value, field, _DNS_LABEL, "a Kubernetes namespace",
                       "A namespace has at most 63 lower-case letters, digits and '-', and starts and ends with a "
                       "letter or digit, e.g. 'ray'")


def check_queue_name(value: object, field: str = "queue_name") -> str | None:
    """A Kueue LocalQueue's name, which goes into the ``kueue.x-k8s.io/queue-name`` label; ``None`` or ``""``: none.

    :raises InvalidInputError: naming the field, the value and the rule.
    """
    if value is None or value == "":
        return None
    return _short_name(value, field, _DNS_SUBDOMAIN, "a Kueue LocalQueue name",
                       "Name a LocalQueue of the cluster's namespace (kubectl get localqueues -n <namespace>): at "
                       "most 63 lower-case letters, digits, '-' and '.', starting and ending with a letter or digit, "
                       "e.g. 'tpu-v6e'")


def label_key_problem(key: object) -> str | None:
    """Why ``key`` is not a label or annotation key (``[prefix/]name``), or ``None``."""
    if not isinstance(key, str):
        return "is not a string"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"has the prefix {prefix!r}, which is not a DNS subdomain (lower case, digits, '-' and '.')"
    if len(name) > LABEL_VALUE_LIMIT or not _LABEL_NAME.fullmatch(name):
        return ("has a name part that is not 1-63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit")
    return None


def label_value_problem(value: object) -> str | None:
    """Why ``value`` is not a label value (empty, or at most 63 characters of the name rule), or ``None``."""
    if not isinstance(value, str):
        return "is not a string"
    if value and (len(value) > LABEL_VALUE_LIMIT or not _LABEL_NAME.fullmatch(value)):
        return "is not a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a " \
               "letter or digit"
    return None


def reserved_key_problem(key: str) -> str | None:
    """Why a user's label or annotation key is not theirs to set (``None`` when it is): this provider finds its
    objects by ``managed-by`` and records owners, shapes and expiry under ``raytpu.dev/``; KubeRay reads and
    writes ``ray.io/`` keys."""
    if key == MANAGED_BY_LABEL:
        return f"is the label this provider finds its own objects by ({MANAGED_BY_LABEL}={MANAGED_BY})"
    if key.startswith(KEY_PREFIX):
        return f"is under {KEY_PREFIX!r}, where this provider records an object's owner, slice shape and expiry"
    if key.startswith(KUBERAY_KEY_PREFIX):
        return f"is under {KUBERAY_KEY_PREFIX!r}, which KubeRay reads and writes"
    return None
