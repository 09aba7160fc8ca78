"""How the fake KubeRay operator treats pods: the reactor's *modes*, global or per cluster."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_UNSCHEDULABLE_MESSAGE = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
DEFAULT_REPLICA_FAILURE_MESSAGE = (
    'pods "{pod}" is forbidden: exceeded quota: tpu-quota, requested: google.com/tpu=4, '
    "used: google.com/tpu=0, limited: google.com/tpu=0"
)


@dataclass(frozen=True)
class Mode:
    """How the fake cluster treats pods: see :func:`auto`, :func:`hold`, :func:`unschedulable`,
    :func:`replica_failure`."""

    kind: str
    delay: float | None = None
    stagger: float | None = None
    reason: str = ""
    message: str = ""


def auto(delay: float | None = None, stagger: float | None = None) -> Mode:
    """Pods become Running+Ready ``delay`` s after creation (default: the reactor's), the n-th
    pending pod of a reconcile pass ``n * stagger`` s later."""
    return Mode("auto", delay=delay, stagger=stagger)


def hold() -> Mode:
    """Pods stay Pending (no scheduling decision yet)."""
    return Mode("hold")


def unschedulable(message: str = DEFAULT_UNSCHEDULABLE_MESSAGE) -> Mode:
    """Pods stay Pending with ``PodScheduled=False`` (reason Unschedulable) and a core Event
    ``FailedScheduling`` carrying ``message``."""
    return Mode("unschedulable", reason="Unschedulable", message=message)


def replica_failure(reason: str = "FailedCreateWorkerPod", message: str | None = None) -> Mode:
    """Worker pods cannot be created: condition ``ReplicaFailure`` True with ``reason``/``message``.
    ``message`` may contain ``{pod}`` (a would-be worker pod name)."""
    return Mode("replica_failure", reason=reason, message=message or DEFAULT_REPLICA_FAILURE_MESSAGE)


_NAMED_MODES = {"auto": auto, "hold": hold, "unschedulable": unschedulable, "replica_failure": replica_failure}


def as_mode(mode: str | Mode) -> Mode:
    if isinstance(mode, Mode):
        return mode
    try:
        return _NAMED_MODES[mode]()
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; one of {sorted(_NAMED_MODES)}") from None

