"""The virtual kubelet's (kubelet.py) start slots: its containers start one at a time, each until its Ray node is
past its agents' start (the dashboard agent wrote its HTTP port file), it has exited, or for
:data:`START_SLOT_SECONDS`. Readiness is no measure of that: a container without an exec probe counts as ready
once it runs (four hosts of a two-slice cluster then started within 2 s, and all four aborted, twice).

On GKE every TPU host is a VM of its own. Here up to seven hosts share 2 cores with the rest of the suite, and a
raylet whose dashboard agent takes over 15 s to start aborts (Ray issue 65983): both hosts of a recreated slice did,
side by side, and came back only after the kubelet's restart back-off.

A mixin: the kubelet owns the stop event.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.controlplane.hostpods import HostProcessPod

PARALLEL_STARTS = 1
START_SLOT_SECONDS = 60.0
READY_SECONDS = 300.0


class StartSlots:
    """The virtual kubelet's ``_take_start_slot`` and ``_wait_ready``."""

    _stop: threading.Event

    def __init__(self) -> None:
        self._start_slots = threading.Semaphore(PARALLEL_STARTS)

    def _take_start_slot(self) -> bool:
        """Wait until a container may start; ``False``: the kubelet is stopping."""
        while not self._stop.is_set():
            if self._start_slots.acquire(timeout=1.0):
                return True
        return False

    def _give_back_start_slot(self) -> None:
        self._start_slots.release()

    def _start_first_container(self, host_pod: HostProcessPod) -> bool:
        """The pod's init containers, then its first container once a slot is free; ``False``: not started (no
        slot is kept)."""
        taken: list[bool] = []

        def take_slot() -> bool:
            taken.append(self._take_start_slot())
            return taken[-1]

        if host_pod.run(self._stop, start_slot=take_slot):
            return True
        if any(taken):  # the pod was stopped while its container waited for the slot
            self._give_back_start_slot()
        return False

    def _wait_ready(self, host_pod: HostProcessPod) -> bool:
        """Give the started container's slot back once its agents have started, it has exited, or after
        :data:`START_SLOT_SECONDS`; then probe it until it is ready (at most :data:`READY_SECONDS`)."""
        try:
            deadline = time.monotonic() + START_SLOT_SECONDS
            while not host_pod.agents_started() and host_pod.exited() is None and time.monotonic() < deadline:
                if self._stop.wait(0.5):
                    break
        finally:
            self._give_back_start_slot()
        return host_pod.wait_ready(timeout=READY_SECONDS, stopping=self._stop)
