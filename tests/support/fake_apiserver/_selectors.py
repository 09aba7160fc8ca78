"""Kubernetes label and field selectors (parse + match) for the fake API server."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """An unparsable or unsupported selector (the server answers 400)."""


_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("gt", "lt"):
            if not present:
                return False
            try:
                number = int(value)
            except (TypeError, ValueError):
                return False
            bound = int(self.values[0])
            return number > bound if self.op == "gt" else number < bound
        raise AssertionError(self.op)


def _split_top_level(selector: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _check_key(key: str, raw: str) -> str:
    if not key or len(key) > 316 or not _KEY_RE.match(key):
        raise SelectorError(
            f'unable to parse requirement: <nil>: Invalid value: "{key}": name part must consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        )
    return key


def _check_value(value: str) -> str:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise SelectorError(
            f'unable to parse requirement: values[0][key]: Invalid value: "{value}": a valid label must be an '
            "empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
            "an alphanumeric character"
        )
    return value


_SET_RE = re.compile(r"^\s*(\S+)\s+(in|notin)\s*\((.*)\)\s*$")


def parse_label_selector(selector: str | None) -> list[Requirement]:
    """Parse a label selector string (=, ==, !=, in, notin, exists, !key, gt, lt)."""
    if selector is None or not selector.strip():
        return []
    reqs: list[Requirement] = []
    for raw in _split_top_level(selector):
        part = raw.strip()
        if not part:
            raise SelectorError(f"found '', expected: identifier in label selector {selector!r}")
        m = _SET_RE.match(part)
        if m:
            values = tuple(sorted({_check_value(v.strip()) for v in m.group(3).split(",")}))
            reqs.append(Requirement(_check_key(m.group(1), part), m.group(2), values))
        elif part.startswith("!"):
            reqs.append(Requirement(_check_key(part[1:].strip(), part), "!"))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            reqs.append(Requirement(_check_key(key.strip(), part), "!=", (_check_value(value.strip()),)))
        elif "==" in part:
            key, value = part.split("==", 1)
            reqs.append(Requirement(_check_key(key.strip(), part), "=", (_check_value(value.strip()),)))
        elif "=" in part:
            key, value = part.split("=", 1)
            reqs.append(Requirement(_check_key(key.strip(), part), "=", (_check_value(value.strip()),)))
        elif ">" in part or "<" in part:
            op = ">" if ">" in part else "<"
            key, value = part.split(op, 1)
            if not value.strip().lstrip("-").isdigit():
                raise SelectorError("unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an "
                                    f"integer: {part!r}")
            reqs.append(Requirement(_check_key(key.strip(), part), "gt" if op == ">" else "lt", (value.strip(),)))
        else:
            if " " in part:
                raise SelectorError(f"unable to parse requirement: found '{part.split()[1]}', "
                                    "expected: in, notin, =, ==, !=, gt, lt")
            reqs.append(Requirement(_check_key(part, part), "exists"))
    return reqs


def labels_match(reqs: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


# --- field selectors ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FieldRequirement:
    field: str
    op: str  # "=" or "!="
    value: str


def _dotted(obj: Mapping[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def _event_source(obj: Mapping[str, Any]) -> str:
    return _dotted(obj, "source.component") or _dotted(obj, "reportingComponent")


def _pod_ips(obj: Mapping[str, Any]) -> str:
    ips = (obj.get("status") or {}).get("podIPs") or []
    return ",".join(ip.get("ip", "") for ip in ips if isinstance(ip, Mapping))


FieldGetter = Callable[[Mapping[str, Any]], str]

_COMMON_FIELDS: dict[str, FieldGetter] = {
    "metadata.name": lambda o: _dotted(o, "metadata.name"),
    "metadata.namespace": lambda o: _dotted(o, "metadata.namespace"),
}

# Field selectors the real API server supports per core resource (k8s.io/kubernetes pkg/registry/*/strategy.go).
EXTRA_FIELDS: dict[str, dict[str, FieldGetter]] = {
    "pods": {
        "spec.nodeName": lambda o: _dotted(o, "spec.nodeName"),
        "spec.restartPolicy": lambda o: _dotted(o, "spec.restartPolicy"),
        "spec.schedulerName": lambda o: _dotted(o, "spec.schedulerName"),
        "spec.serviceAccountName": lambda o: _dotted(o, "spec.serviceAccountName"),
        "spec.hostNetwork": lambda o: _dotted(o, "spec.hostNetwork") or "false",
        "status.phase": lambda o: _dotted(o, "status.phase"),
        "status.podIP": lambda o: _dotted(o, "status.podIP"),
        "status.podIPs": _pod_ips,
        "status.nominatedNodeName": lambda o: _dotted(o, "status.nominatedNodeName"),
    },
    "events": {
        **{f"involvedObject.{f}": (lambda field: lambda o: _dotted(o, f"involvedObject.{field}"))(f)
           for f in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
        "reason": lambda o: _dotted(o, "reason"),
        "reportingComponent": lambda o: _dotted(o, "reportingComponent"),
        "source": _event_source,
        "type": lambda o: _dotted(o, "type"),
    },
    "secrets": {"type": lambda o: _dotted(o, "type")},
    "services": {
        "spec.clusterIP": lambda o: _dotted(o, "spec.clusterIP"),
        "spec.type": lambda o: _dotted(o, "spec.type"),
    },
}


def parse_field_selector(selector: str | None, plural: str, *,
                         custom: bool) -> list[tuple[FieldRequirement, FieldGetter]]:
    """Parse a field selector; unsupported fields raise SelectorError with the real server's message."""
    if selector is None or not selector.strip():
        return []
    supported = dict(_COMMON_FIELDS)
    supported.update(EXTRA_FIELDS.get(plural, {}))
    out = []
    for raw in selector.split(","):
        part = raw.strip()
        if not part:
            continue
        if "!=" in part:
            field, value, op = *part.split("!=", 1), "!="
        elif "==" in part:
            field, value, op = *part.split("==", 1), "="
        elif "=" in part:
            field, value, op = *part.split("=", 1), "="
        else:
            raise SelectorError(f"invalid selector: '{selector}'; can't understand '{part}'")
        field = field.strip()
        if field not in supported:
            if custom:
                raise SelectorError(f'"{field}" is not a known field selector: '
                                    'only "metadata.name", "metadata.namespace"')
            raise SelectorError(f"field label not supported: {field}")
        out.append((FieldRequirement(field, op, value.strip()), supported[field]))
    return out


def fields_match(reqs: list[tuple[FieldRequirement, FieldGetter]], obj: Mapping[str, Any]) -> bool:
    for req, getter in reqs:
        actual = getter(obj)
        if req.op == "=" and actual != req.value:
            return False
        if req.op == "!=" and actual == req.value:
            return False
    return True
