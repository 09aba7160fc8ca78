"""Usage records: chip-hours from ready to gone by capacity kind, slices made again, and an estimate from prices."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator
from airflow_provider_raytpu.status.usage import describe_usage, tpu_usage
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.values import check_prices

READY = datetime(2026, 12, 4, 2, 0, 0, tzinfo=UTC)
SPOT_SLICES = TpuSlice("v6e", "4x4", num_slices=2, capacity="spot")


def cluster(tpu: TpuSlice, ready: datetime | None = READY) -> dict:
    made = build_ray_cluster(name="nightly", namespace="ml", tpu=tpu)
    made["metadata"]["creationTimestamp"] = "2026-12-04T01:50:00Z"
    made["status"] = {"state": "ready", "stateTransitionTimes": {"ready": ready.strftime("%Y-%m-%dT%H:%M:%SZ")}} \
        if ready else {}
    return made


def host(replica: str, created: datetime) -> dict:
    return {"metadata": {"labels": {"ray.io/node-type": "worker", "ray.io/worker-group-replica-index": replica},
                         "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")}}


def test_chip_hours_are_the_chips_times_ready_to_gone_under_the_clusters_capacity() -> None:
    before, after = READY - timedelta(minutes=5), READY + timedelta(minutes=40)
    # slice 1 made again: its hosts came back a few seconds apart, the first one counts
    pods = [host("0", before), host("0", before), host("1", after + timedelta(seconds=3)), host("1", after)]
    usage = tpu_usage(cluster(SPOT_SLICES), pods, SPOT_SLICES, READY + timedelta(hours=1, minutes=30),
                      check_prices({"v6e": {"spot": 1.25, "on-demand": 3}}))
    assert usage == {
        "cluster_name": "nightly", "namespace": "ml", "accelerator": "v6e", "topology": "4x4", "num_slices": 2,
        "chips": 32, "capacity": "spot", "created_at": "2026-12-04T01:50:00+00:00",
        "ready_at": "2026-12-04T02:00:00+00:00",
        "gone_at": "2026-12-04T03:30:00+00:00", "hours": 1.5, "chip_hours": {"spot": 48.0},
        "slices_recreated": 1, "estimated_cost": {"spot": 60.0},
        "slices": [{"index": 0, "made_again_at": None}, {"index": 1, "made_again_at": "2026-12-04T02:40:00+00:00"}],
    }
    assert describe_usage(usage) == ("RayCluster ml/nightly used 48 chip-hours of spot (32 chips for 90.0 min from "
                                      "ready to gone), 1 slice(s) made again meanwhile; estimated cost 60")


def test_no_estimate_without_a_price_for_the_generation_and_kind_and_none_for_a_cluster_never_ready() -> None:
    reserved = TpuSlice("v5e", "2x4", capacity="reservation:r1")
    usage = tpu_usage(cluster(reserved), [], reserved, READY + timedelta(hours=2), check_prices({"v6e": {"spot": 1}}))
    assert usage["chip_hours"] == {"reservation": 16.0} and "estimated_cost" not in usage
    never = tpu_usage(cluster(reserved, ready=None), [], reserved, READY, None)
    assert (never["ready_at"], never["hours"], never["chip_hours"]) == (None, 0.0, {"reservation": 0.0})
    assert describe_usage(never) == "RayCluster ml/nightly was never ready: no chip-hours"


@pytest.mark.parametrize("prices", [{"v6e": 2.7}, {"v6e": {"spot": "cheap"}}, {"v6e": {"spot": -1}}, ["v6e"],
                                    {"v6e": {"spot": True}}])
def test_a_price_table_that_is_not_one_is_refused_when_the_dag_is_parsed(prices: object) -> None:
    with pytest.raises(InvalidInputError, match=r"chip_hour_prices=.*: is not a table of prices by generation and "
                                                r"capacity kind. Give e.g. \{\"v6e\": \{\"on-demand\": 2.7"):
        DeleteRayClusterOperator(task_id="delete", chip_hour_prices=prices)  # type: ignore[arg-type]
