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

A head group in ``RESCHEDULING`` has lost its host. Ray Train holds a head group only until
the worker group's own placement group is placed (``SlicePlacementGroup.release_head_pgs``),
and removes its own again, idempotently; so :class:`SliceHeadJanitor` removes every head
group that is waiting for a new host, before the replacement host can be taken by it.
"""

from __future__ import annotations

import re
import sys
import threading
from types import TracebackType
from typing import Any

HEAD_RESOURCE = re.compile(r"TPU-[\w-]+-head")
RESCHEDULING = "RESCHEDULING"
SWEEP_SECONDS = 1.0


def is_lost_slice_head(group: dict[str, Any]) -> bool:
    """Whether a ``ray.util.placement_group_table()`` entry is a slice-head reservation whose host is gone.

    :param group: one entry of the table: its ``state``, ``name`` and ``bundles``.
    """
    bundles = list(group.get("bundles", {}).values())
    return (group.get("state") == RESCHEDULING and not group.get("name") and len(bundles) == 1
            and len(bundles[0]) == 1 and all(HEAD_RESOURCE.fullmatch(name) for name in bundles[0]))


def remove_lost_slice_heads() -> list[str]:
    """Remove every slice-head placement group waiting for a new host; needs a connected Ray.

    :return: the ids of the groups removed.
    """
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = []
    for group_id, group in placement_group_table().items():
        if is_lost_slice_head(group):
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            removed.append(group_id)
    return removed


class SliceHeadJanitor:
    """While entered, removes every lost slice-head reservation (:func:`remove_lost_slice_heads`) each second.

    Each removal is printed to stderr, which the job's log carries.

    :param interval: seconds between two sweeps.
    """

    def __init__(self, interval: float = SWEEP_SECONDS) -> None:
        self.interval = interval
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
        while not self._stopping.wait(self.interval):
            try:
                removed = remove_lost_slice_heads()
            except Exception as error:  # a GCS that does not answer for a moment; the next sweep tries again
                print(f"slice-head janitor: could not list placement groups: {error}", file=sys.stderr, flush=True)
                continue
            for group_id in removed:
                print(f"Removed TPU slice-head reservation {group_id}: its host is gone and Ray left it to take "
                      "the replacement host's head (Ray 2.60 reserve_tpu_slice)", file=sys.stderr, flush=True)
            self.removed += removed
