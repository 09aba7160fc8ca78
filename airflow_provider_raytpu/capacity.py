"""Where a slice's TPUs come from, and what a TPU host pod says to GKE to get them.

One value names the capacity: ``on-demand``, ``spot``, ``reservation:<name>`` (``reservation:<project>/<name>``
for a reservation shared from another project, ``reservation:any`` for any matching one) or ``flex-start``
(``flex-start:<max run duration>``). Each renders what GKE documents for its kind, cited where it is rendered.
Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError

ON_DEMAND = "on-demand"
SPOT = "spot"
RESERVATION = "reservation"
FLEX_START = "flex-start"
KINDS = (ON_DEMAND, SPOT, RESERVATION, FLEX_START)
#: ``reservation:any``: whichever matching reservation the node pool consumes.
ANY_RESERVATION = "any"
#: Flex-start VMs run at most seven days (GKE, "About flex-start provisioning mode").
MAX_RUN_SECONDS = 7 * 24 * 3600

GKE_SPOT_LABEL = "cloud.google.com/gke-spot"
GKE_FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT_LABEL = "cloud.google.com/reservation-project"

FORMS = (f"{ON_DEMAND}, {SPOT}, {RESERVATION}:<name> ({RESERVATION}:<project>/<name> for a shared reservation, "
         f"{RESERVATION}:{ANY_RESERVATION} for any matching one), {FLEX_START} or {FLEX_START}:<max run duration> "
         "such as flex-start:24h")

# Compute Engine resource names and project ids (https://cloud.google.com/compute/docs/naming-resources).
_RESOURCE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_PROJECT_ID = re.compile(r"[a-z][-a-z0-9]{4,28}[a-z0-9]")
_DURATION = re.compile(r"(\d+)\s*([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Capacity:
    """The kind of TPU capacity a slice runs on.

    :param kind: one of :data:`KINDS`.
    :param reservation: with ``reservation``: the reservation's name, or :data:`ANY_RESERVATION`.
    :param project: with a named reservation shared from another project: that project.
    :param max_run_seconds: with ``flex-start``: how long its VMs may run (GKE's default and most: seven days).
    """

    kind: str = ON_DEMAND
    reservation: str | None = None
    project: str | None = None
    max_run_seconds: int | None = None

    @classmethod
    def parse(cls, value: Any, field: str = "capacity") -> Capacity:
        """Read one capacity as a user writes it: ``"spot"``, ``"reservation:r1"``, ``"flex-start:24h"``.

        :raises InvalidInputError: naming the value and the accepted forms.
        """
        if isinstance(value, Capacity):
            return value
        if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
            return cls()
        if not isinstance(value, str):
            raise InvalidInputError(field, value, "is not one capacity", f"Write one of {FORMS}")
        kind, _, detail = value.strip().partition(":")
        kind, detail = kind.strip().lower(), detail.strip()
        if kind == RESERVATION:
            return _reservation(value, detail, field)
        if kind == FLEX_START:
            return cls(FLEX_START, max_run_seconds=_max_run_seconds(value, detail, field) if detail else None)
        if kind in (ON_DEMAND, SPOT) and not detail:
            return cls(kind)
        raise InvalidInputError(field, value, "is not a capacity", f"Write one of {FORMS}")

    def lifetime(self, max_lifetime: timedelta) -> timedelta:
        """A cluster's ``max_lifetime`` on this capacity: no longer than a flex-start slice's max run duration,
        when GKE reclaims its VMs."""
        run = self.max_run_seconds
        return min(max_lifetime, timedelta(seconds=run)) if run else max_lifetime

    def __str__(self) -> str:
        if self.kind == RESERVATION:
            return f"{RESERVATION}:{self.project + '/' if self.project else ''}{self.reservation}"
        if self.kind == FLEX_START and self.max_run_seconds:
            return f"{FLEX_START}:{_readable(self.max_run_seconds)}"
        return self.kind

    def describe(self) -> str:
        """For logs: ``spot``, ``reservation r1``, ``flex-start, at most 1d``."""
        if self.kind == RESERVATION:
            shared = f" of project {self.project}" if self.project else ""
            return ("any matching reservation" if self.reservation == ANY_RESERVATION
                    else f"reservation {self.reservation}{shared}")
        if self.kind == FLEX_START and self.max_run_seconds:
            return f"{FLEX_START}, at most {_readable(self.max_run_seconds)}"
        return self.kind

    @property
    def node_selector(self) -> dict[str, str]:
        """The node labels a TPU host pod selects for this capacity, as GKE documents them:

        - spot: ``cloud.google.com/gke-spot: "true"`` (GKE, "Spot VMs": select the label with a nodeSelector);
        - a named reservation: ``cloud.google.com/reservation-name`` and ``cloud.google.com/reservation-affinity:
          "specific"``, and ``cloud.google.com/reservation-project`` for a shared one (GKE, "Consuming reserved
          zonal resources"; the compute class field ``reservations.specific.project`` maps to the last). TPU
          reservations are consumed with specific affinity only (GKE, "About custom compute classes");
        - ``reservation:any``: nothing. A Standard node pool made with ``--reservation-affinity=any`` consumes a
          matching reservation; a pod cannot ask for "any" (GKE, "Consuming reserved zonal resources");
        - flex-start: ``cloud.google.com/gke-flex-start: "true"`` (the Job of GKE's "Run a small batch workload
          with flex-start VMs"). Its max run duration is the node pool's (``--max-run-duration``), not the pod's.
        """
        if self.kind == SPOT:
            return {GKE_SPOT_LABEL: "true"}
        if self.kind == FLEX_START:
            return {GKE_FLEX_START_LABEL: "true"}
        if self.kind == RESERVATION and self.reservation != ANY_RESERVATION:
            selector = {RESERVATION_NAME_LABEL: str(self.reservation), RESERVATION_AFFINITY_LABEL: "specific"}
            if self.project:
                selector[RESERVATION_PROJECT_LABEL] = self.project
            return selector
        return {}

    @property
    def tolerations(self) -> list[dict[str, str]]:
        """Tolerations of the taints GKE may put on nodes of this capacity: ``cloud.google.com/gke-spot=true``
        on a spot pool made with that taint (GKE, "Spot VMs"), and ``cloud.google.com/gke-flex-start``, which
        GKE's cluster autoscaler names a label and optional taint key of flex-start nodes. A toleration of a
        taint a node does not have changes nothing."""
        if self.kind == SPOT:
            return [{"key": GKE_SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
        if self.kind == FLEX_START:
            return [{"key": GKE_FLEX_START_LABEL, "operator": "Exists", "effect": "NoSchedule"}]
        return []


def parse_capacities(value: Any, field: str = "capacity") -> tuple[Capacity, ...]:
    """One capacity, or several to try in order: ``["reservation:r1", "spot"]``, or as a template renders a list
    (``"['reservation:r1', 'spot']"``) or a UI param writes it (``"reservation:r1, spot"``).

    :raises InvalidInputError: for a value :meth:`Capacity.parse` refuses, an empty list and a kind listed twice.
    """
    if isinstance(value, str) and "," in value:
        value = [part.strip().strip("'\"") for part in value.strip().strip("[]()").split(",")]
    if not isinstance(value, (list, tuple)):
        return (Capacity.parse(value, field),)
    if any(item is None or (isinstance(item, str) and not item.strip()) for item in value):
        raise InvalidInputError(field, value, "has an empty entry", "List capacities such as reservation:r1, spot")
    kinds = tuple(Capacity.parse(item, field) for item in value)
    if not kinds:
        raise InvalidInputError(field, value, "lists no capacity", f"Write one of {FORMS}, or a list of them")
    if len(set(kinds)) < len(kinds):
        raise InvalidInputError(field, value, "lists a capacity twice",
                                "List each capacity once, in the order to try them")
    return kinds


def with_spot(spot: bool, capacity: Any, field: str = "capacity") -> Capacity:
    """``capacity``, or spot capacity for the deprecated ``spot=True``; the two must agree when both are given."""
    parsed = Capacity.parse(capacity, field)
    if spot and parsed.kind not in (SPOT, ON_DEMAND):
        raise InvalidInputError(
            "spot/capacity", (spot, capacity), f"ask for spot and for {parsed.describe()} at once",
            f"Write capacity={str(parsed)!r} alone (spot=True is the deprecated spelling of capacity='spot')")
    return Capacity(SPOT) if spot else parsed


def _reservation(value: str, detail: str, field: str) -> Capacity:
    project, _, name = detail.rpartition("/")
    if name == ANY_RESERVATION and not project:
        return Capacity(RESERVATION, ANY_RESERVATION)
    if not _RESOURCE_NAME.fullmatch(name):
        raise InvalidInputError(
            field, value, f"does not name a reservation: {name!r} is not a Compute Engine resource name",
            f"Write {RESERVATION}:<name> (lowercase letters, digits and hyphens, at most 63), "
            f"{RESERVATION}:<project>/<name> or {RESERVATION}:{ANY_RESERVATION}")
    if project and not _PROJECT_ID.fullmatch(project):
        raise InvalidInputError(field, value, f"{project!r} is not a Google Cloud project id",
                                f"Write {RESERVATION}:<project>/<name>, e.g. reservation:my-project/{name}")
    return Capacity(RESERVATION, name, project or None)


def _max_run_seconds(value: str, detail: str, field: str) -> int:
    fix = f"Write {FLEX_START} (seven days) or {FLEX_START}:<duration> up to 7d, such as flex-start:24h or :90m"
    match = _DURATION.fullmatch(detail.lower())
    if not match:
        raise InvalidInputError(field, value, f"{detail!r} is not a duration", fix)
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not 0 < seconds <= MAX_RUN_SECONDS:
        raise InvalidInputError(field, value, "is not a max run duration flex-start offers (more than zero, at "
                                "most seven days)", fix)
    return seconds


def _readable(seconds: int) -> str:
    for unit in ("d", "h", "m"):
        if seconds % _UNIT_SECONDS[unit] == 0:
            return f"{seconds // _UNIT_SECONDS[unit]}{unit}"
    return f"{seconds}s"
