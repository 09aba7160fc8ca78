"""Errors the provider raises for problems a user must fix; no retry can."""

from __future__ import annotations

from typing import Any


class FatalError(Exception):
    """A problem no retry of the same task can fix; operators fail without retrying."""


class InvalidInputError(FatalError, ValueError):
    """A task input is wrong; the message names the field, the value and the fix.

    Raised before anything is created.

    :param field: the parameter as the user wrote it, e.g. ``topology``.
    :param value: the value that was given.
    :param problem: what is wrong with it.
    :param fix: what to write instead.
    """

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}. {fix}")


class ConflictError(FatalError):
    """A resource of that name exists and is not the one this task would create."""


class PermissionDeniedError(FatalError):
    """The connection's identity lacks a permission (Kubernetes RBAC, IAM)."""
