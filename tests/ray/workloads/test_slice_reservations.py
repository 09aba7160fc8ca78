"""Ray's leaked slice-head reservation, and the janitor the training job runs against it, on an emulated slice.

The orphan is made as ``reserve_tpu_slice`` makes its head reservation (Ray 2.60,
``ray/_private/accelerators/tpu.py``) and then left unheld, as that function leaves it when
reading the slice name fails because host 0 died. Host 0 is then lost and replaced, as
KubeRay replaces a preempted slice's hosts; the next reservation is Ray's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from airflow_provider_raytpu.workloads.slice_reservations import LostHeads, SliceHeadJanitor, is_slice_head
from tests.ray.workloads.ray_slice import SLICE, EmulatedSlice
from tests.support.gcs import wait_for

pytestmark = pytest.mark.ray


def state(group: Any) -> str:
    from ray.util.placement_group import placement_group_table

    return str(placement_group_table(group)["state"])


@pytest.fixture
def orphan(ray_client: EmulatedSlice) -> Iterator[Any]:
    """A placed slice-head reservation that no one holds; afterwards the slice has its hosts again."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles=[{SLICE.head_resource: 1}], bundle_label_selector=[
        {"ray.io/tpu-worker-id": "0", "ray.io/tpu-pod-type": SLICE.pod_type}])
    ray.get(group.ready(), timeout=60)
    try:
        yield group
    finally:
        remove_placement_group(group)
        ray_client.ensure_hosts()


def replace_host_0(ray_slice: EmulatedSlice, orphan: Any, orphan_state: str) -> None:
    ray_slice.kill_host(0)
    assert wait_for(lambda: state(orphan) == orphan_state, 60), f"{state(orphan)}, not {orphan_state}"
    ray_slice.add_host(0)


def test_unheld_the_reservation_takes_the_replacement_host_and_the_next_one_times_out(
        ray_client: EmulatedSlice, orphan: Any) -> None:
    from ray._private.accelerators.tpu import reserve_tpu_slice

    replace_host_0(ray_client, orphan, "RESCHEDULING")
    assert wait_for(lambda: state(orphan) == "CREATED", 60), state(orphan)
    with pytest.raises(TimeoutError, match="Failed to reserve TPU head for slice with shape: v4-16"):
        reserve_tpu_slice(SLICE.topology, SLICE.ray_accelerator_type, timeout_s=5)


def test_the_janitor_removes_it_once_placed_again_unused_and_the_next_reservation_gets_the_new_host(
        ray_client: EmulatedSlice, orphan: Any) -> None:
    from ray._private.accelerators.tpu import reserve_tpu_slice
    from ray.util.placement_group import remove_placement_group

    with SliceHeadJanitor(interval=0.5, grace=3.0) as janitor:
        assert not wait_for(lambda: janitor.removed, 2), "a placed reservation is left alone"
        replace_host_0(ray_client, orphan, "RESCHEDULING")
        assert wait_for(lambda: state(orphan) == "REMOVED", 90), state(orphan)
        reservation = reserve_tpu_slice(SLICE.topology, SLICE.ray_accelerator_type, timeout_s=60)
        assert reservation is not None
        slice_name, head = reservation
        remove_placement_group(head)
    assert slice_name == ray_client.name
    assert janitor.removed == [orphan.id.hex()]


HEAD = {"name": "", "bundles": {0: {"TPU-v4-16-head": 1.0}}}


@pytest.mark.parametrize(("group", "head"), [
    (HEAD, True),
    ({"name": "", "bundles": {0: {"TPU-v6e-16-head": 1.0}}}, True),
    ({"name": "mine", "bundles": {0: {"TPU-v4-16-head": 1.0}}}, False),
    ({"name": "", "bundles": {0: {"TPU": 4.0}, 1: {"TPU": 4.0}}}, False),
    ({"name": "", "bundles": {0: {"TPU-v4-16-head": 1.0, "CPU": 1.0}}}, False),
])
def test_a_slice_head_reservation_is_one_unnamed_bundle_of_a_head_resource(group: dict[str, Any], head: bool) -> None:
    assert is_slice_head(group) is head


def test_a_head_that_lost_its_host_is_leaked_once_held_again_for_the_grace_period_and_never_while_it_waits() -> None:
    lost = LostHeads(grace=30)
    at = {"created": {"g": {**HEAD, "state": "CREATED"}}, "waiting": {"g": {**HEAD, "state": "RESCHEDULING"}}}
    assert lost.leaked(at["created"], 0) == []  # placed, never lost: a reservation in progress
    assert lost.leaked(at["created"], 100) == []
    assert lost.leaked(at["waiting"], 101) == []  # its host is gone: its name task may still wait in it
    assert lost.leaked(at["waiting"], 500) == []
    assert lost.leaked(at["created"], 501) == []  # placed again: its reservation has the grace period
    assert lost.leaked(at["created"], 530) == []
    assert lost.leaked(at["created"], 531) == ["g"]
    assert lost.leaked(at["created"], 600) == [], "asked for once"
    assert lost.leaked({}, 601) == []
