"""API errors as the real server shapes them: ``Status`` bodies, reasons and messages."""

from __future__ import annotations

from typing import Any

from ._resources import ResourceType


class ApiError(Exception):
    """An API error answered as a ``Status`` body, exactly as the real server shapes it."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict:
        return status_body(self.code, self.reason, self.message, self.details)

    @classmethod
    def not_found(cls, res: ResourceType, name: str) -> ApiError:
        return cls(404, "NotFound", f'{res.qualified} "{name}" not found', res.details(name))

    @classmethod
    def already_exists(cls, res: ResourceType, name: str) -> ApiError:
        return cls(409, "AlreadyExists", f'{res.qualified} "{name}" already exists', res.details(name))

    @classmethod
    def conflict(cls, res: ResourceType, name: str, why: str | None = None) -> ApiError:
        why = why or "the object has been modified; please apply your changes to the latest version and try again"
        return cls(409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} "{name}": {why}',
                   res.details(name))

    @classmethod
    def forbidden(cls, res: ResourceType | None, verb: str, namespace: str | None, name: str | None,
                  user: str, subresource: str | None = None) -> ApiError:
        plural = res.plural if res else ""
        group = res.group if res else ""
        qualified = f"{plural}.{group}" if group else plural
        resource = f"{plural}/{subresource}" if subresource else plural
        subject = f'{qualified} "{name}"' if name else qualified
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        msg = (f'{subject} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
               f'in API group "{group}" {scope}')
        details: dict[str, Any] = {}
        if name:
            details["name"] = name
        if group:
            details["group"] = group
        details["kind"] = plural
        return cls(403, "Forbidden", msg, details)

    @classmethod
    def invalid(cls, res: ResourceType, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
        """``causes``: (reason, field, message) like ("FieldValueRequired", "metadata.name", "Required value: ...")."""
        text = ", ".join(f"{f}: {m}" for _, f, m in causes)
        if len(causes) > 1:
            text = f"[{text}]"
        details = {"name": name}
        if res.group:
            details["group"] = res.group
        details["kind"] = res.kind
        details["causes"] = [{"reason": r, "message": m, "field": f} for r, f, m in causes]
        return cls(422, "Invalid", f'{res.qualified_kind} "{name}" is invalid: {text}', details)

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)

    @classmethod
    def unprocessable(cls, server_message: str) -> ApiError:
        return cls(422, "Invalid", "the server rejected our request due to an error in our request",
                   {"causes": [{"reason": "UnexpectedServerResponse", "message": server_message}]})

    @classmethod
    def unsupported_media_type(cls, content_type: str, res: ResourceType | None) -> ApiError:
        accepted = ["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]
        if res is not None and not res.custom:
            accepted.insert(2, "application/strategic-merge-patch+json")
        return cls(415, "UnsupportedMediaType",
                   "the body of the request was in an unknown format - accepted media types include: "
                   + ", ".join(accepted))

    @classmethod
    def not_found_path(cls) -> ApiError:
        return cls(404, "NotFound", "the server could not find the requested resource", {})

    @classmethod
    def method_not_allowed(cls) -> ApiError:
        return cls(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason}
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body

