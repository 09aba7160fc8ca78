"""Why a local cluster's supervisor should stop: nobody can use the cluster's processes any more.

Its state directory is gone (a removed home, a killed test run's temp dir) or now names another
incarnation, or the cluster's expiry (``raytpu.dev/expires-at``, from ``max_lifetime``) has
passed. The expiry is read again from the stored manifest before it counts, since a create task
that adopted the cluster may have renewed it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.process import read_json
from airflow_provider_raytpu.backends.local.state import MANIFEST_FILE, SUPERVISOR_FILE
from airflow_provider_raytpu.manifests.raycluster import EXPIRES_AT_ANNOTATION, parse_expiry

OWNERSHIP_CHECK_SECONDS = 5.0


@dataclass(frozen=True)
class Stop:
    """A reason to stop; ``failure`` (reason, message) when the stop is also the cluster's failure."""

    why: str
    failure: tuple[str, str] | None = None


def expiry_of(manifest: dict[str, Any]) -> str | None:
    """The manifest's ``raytpu.dev/expires-at`` annotation."""
    value = ((manifest.get("metadata") or {}).get("annotations") or {}).get(EXPIRES_AT_ANNOTATION)
    return None if value is None else str(value)


class StopReasons:
    """Answers :meth:`check` once per supervisor loop; reads files only when a reason may apply.

    :param state_dir: the cluster's state directory.
    :param incarnation: the supervisor's incarnation; another one in ``supervisor.json`` owns the directory.
    :param expiry: the expiry annotation of the manifest the supervisor started with.
    """

    def __init__(self, state_dir: Path, incarnation: str, expiry: str | None) -> None:
        self.state_dir = state_dir
        self.incarnation = incarnation
        self.expiry = expiry
        self.expires_at = self._timestamp(expiry)
        self.next_ownership_check = 0.0

    def check(self) -> Stop | None:
        """Why nobody can use this cluster any more (its processes should go), or ``None``."""
        if not self.state_dir.is_dir():
            return Stop(f"state directory {self.state_dir} is gone")
        if self.expires_at is not None and time.time() >= self.expires_at and self._expiry_passed():
            return Stop("its expiry has passed", ("Expired", f"the cluster's max_lifetime ended at {self.expiry}: "
                                                  "its Ray processes were stopped. Delete it "
                                                  "(DeleteExpiredRayClustersOperator does)"))
        if time.monotonic() >= self.next_ownership_check:
            self.next_ownership_check = time.monotonic() + OWNERSHIP_CHECK_SECONDS
            recorded = read_json(self.state_dir / SUPERVISOR_FILE)
            if recorded and recorded.get("incarnation") not in (None, self.incarnation):
                return Stop(f"{self.state_dir} now belongs to incarnation {recorded['incarnation']}")
        return None

    def _expiry_passed(self) -> bool:
        """Whether the expiry in the stored manifest has passed."""
        self.expiry = expiry_of(read_json(self.state_dir / MANIFEST_FILE) or {})
        self.expires_at = self._timestamp(self.expiry)
        return self.expires_at is not None and time.time() >= self.expires_at

    @staticmethod
    def _timestamp(expiry: str | None) -> float | None:
        """The expiry as a Unix time; ``None`` when there is none or it is not a time (it never stops the cluster)."""
        if not expiry:
            return None
        with contextlib.suppress(ValueError):
            return parse_expiry(expiry).timestamp()
        return None
