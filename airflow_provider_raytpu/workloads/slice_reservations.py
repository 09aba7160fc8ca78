"""Frees the TPU slice-head reservations Ray leaks when a slice's host dies while it is reserved.

Ray Train reserves a multi-host slice with ``reserve_tpu_slice`` (Ray 2.60,
``ray/_private/accelerators/tpu.py``): a placement group of one bundle on the slice's head
resource (``TPU-<pod type>-head``, on host 0), then a task in that group reads the slice's
name. When that task fails because the host died meanwhile, as when one host of a slice is
preempted and KubeRay deletes the others to recreate the slice, the exception leaves before
the group is handed back to Ray Train, so nothing removes it until the Train controller
exits. Ray reschedules it instead, and once the replacement slice's host 0 registers, the
orphan holds its head resource: every later reservation of that slice waits its 60 s and
fails, and Ray Train starts its worker group again, forever.

The group must not be removed while it waits for a new host: when the host died before the
task ran, the task still waits in the group and runs once Ray places it again, and the
reservation goes on (removed, the task could never run, and the reservation would wait
forever). So :class:`SliceHeadJanitor` removes a head group that lost its host only once Ray
has placed it again and it has been held for a grace period longer than the rest of a
reservation: Ray Train holds a head group only until the worker group's own placement group is
placed (``SlicePlacementGroup.release_head_pgs``), and removes its own again idempotently.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from types import TracebackType
from typing import Any

HEAD_RESOURCE = re.compile(r"TPU-[\w-]+-head")
RESCHEDULING = "RESCHEDULING"
CREATED = "CREATED"
SWEEP_SECONDS = 1.0
GRACE_SECONDS = 30.0


def is_slice_head(group: dict[str, Any]) -> bool:
    """Whether a ``ray.util.placement_group_table()`` entry is a slice-head reservation as Ray makes it.

    :param group: one entry of the table: its ``name`` and ``bundles``.
    """
    bundles = list(group.get("bundles", {}).values())
    return (not group.get("name") and len(bundles) == 1 and len(bundles[0]) == 1
            and all(HEAD_RESOURCE.fullmatch(name) for name in bundles[0]))


class LostHeads:
    """Which slice-head groups lost their host (seen ``RESCHEDULING``) and how long each has been placed again.

    :param grace: seconds a group that lost its host may be held again before it counts as leaked.
    """

    def __init__(self, grace: float = GRACE_SECONDS) -> None:
        self.grace = grace
        self._lost: set[str] = set()
        self._placed_again: dict[str, float] = {}

    def leaked(self, table: dict[str, dict[str, Any]], now: float) -> list[str]:
        """The ids of the groups to remove, given the placement-group table read at ``now`` (monotonic seconds)."""
        heads = {group_id: group["state"] for group_id, group in table.items() if is_slice_head(group)}
        self._lost = {group_id for group_id in self._lost if group_id in heads} | {
            group_id for group_id, state in heads.items() if state == RESCHEDULING}
        for group_id in self._lost:
            if heads[group_id] == CREATED:
                self._placed_again.setdefault(group_id, now)
        self._placed_again = {group_id: since for group_id, since in self._placed_again.items()
                              if heads.get(group_id) == CREATED}
        leaked = [group_id for group_id, since in self._placed_again.items() if now - since >= self.grace]
        for group_id in leaked:  # asked for once: the table may still list it before the removal lands
            self._lost.discard(group_id)
            del self._placed_again[group_id]
        return leaked


def remove_groups(group_ids: list[str]) -> None:
    """Remove placement groups by id; needs a connected Ray."""
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for group_id in group_ids:
        remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))


class SliceHeadJanitor:
    """While entered, removes each leaked slice-head reservation (:class:`LostHeads`), looking every second.

    Each removal is printed to stderr, which the job's log carries.

    :param interval: seconds between two looks at Ray's placement groups.
    :param grace: seconds a head group placed again after losing its host is left to its reservation.
    """

    def __init__(self, interval: float = SWEEP_SECONDS, grace: float = GRACE_SECONDS) -> None:
        self.interval = interval
        self.lost = LostHeads(grace)
        self.removed: list[str] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slice-head-janitor", daemon=True)

    def __enter__(self) -> SliceHeadJanitor:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stopping.set()
        self._thread.join(timeout=self.interval + 10)

    def _run(self) -> None:
        from ray.util.placement_group import placement_group_table

        while not self._stopping.wait(self.interval):
            try:
                leaked = self.lost.leaked(placement_group_table(), time.monotonic())
                remove_groups(leaked)
            except Exception as error:  # a GCS that does not answer for a moment; the next look tries again
                print(f"slice-head janitor: could not read or remove placement groups: {error}", file=sys.stderr,
                      flush=True)
                continue
            for group_id in leaked:
                print(f"Removed TPU slice-head reservation {group_id}: it lost its host, then held the replacement "
                      f"host's head for {self.lost.grace:.0f} s with no reservation using it (Ray 2.60 "
                      "reserve_tpu_slice)", file=sys.stderr, flush=True)
            self.removed += leaked
