"""One slice value per task (SliceFields): what a training task states is compared with the cluster field by
field, and each deprecated slice spelling still works and warns, naming its replacement."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator
from airflow_provider_raytpu.tasks.slices import SliceFields
from airflow_provider_raytpu.tpu import TpuSlice

CLUSTER = "RayCluster ml/train"
#: Two v6e 2x4 slices of two 4-chip hosts each, on demand.
RECORDED = TpuSlice("v6e", "2x4", num_slices=2, chips_per_host=4)
TRAIN = {"task_id": "train", "cluster_name": "train", "train_loop": "m:f", "checkpoint_uri": "gs://b/c"}


@pytest.mark.parametrize("stated", [
    {}, {"accelerator": "TPU-V6E"}, {"topology": "2x4"}, {"num_slices": "2"}, {"chips_per_host": 4},
    {"capacity": "on-demand"}, {"accelerator": "v6e", "topology": "2x4", "num_slices": 2, "chips_per_host": "4",
                                "capacity": "on-demand"},
])
def test_every_field_a_training_task_states_that_the_cluster_agrees_with_trains_on_the_cluster(
        stated: dict[str, Any]) -> None:
    assert SliceFields(**stated).against(RECORDED, CLUSTER) is RECORDED


@pytest.mark.parametrize(("stated", "said"), [
    ({"capacity": "spot"}, "capacity='spot': disagrees with RayCluster ml/train, which is v6e 2x4 x 2 slices (2 hosts "
                           "x 4 chips each, 16 chips). Write capacity='on-demand', or leave it unset to train on the "
                           "cluster's slice"),
    ({"accelerator": "v5e"}, "accelerator='v5e': disagrees with RayCluster ml/train"),
    ({"topology": "4x4"}, "topology='4x4': disagrees"),
    ({"num_slices": 1}, "num_slices=1: disagrees"),
    ({"chips_per_host": 8}, "chips_per_host=8: disagrees"),
    ({"topology": "4x4", "num_slices": 1}, "topology/num_slices=('4x4', 1): disagrees with RayCluster ml/train, "
                                           "which is v6e 2x4 x 2 slices (2 hosts x 4 chips each, 16 chips). Write "
                                           "topology='2x4', num_slices=2, or leave them unset"),
])
def test_a_field_the_cluster_disagrees_with_is_named_with_both_values(stated: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        SliceFields(**stated).against(RECORDED, CLUSTER)
    assert said in str(info.value)


def test_the_deprecated_spot_flag_is_stated_as_spot_capacity() -> None:
    with pytest.raises(InvalidInputError, match="capacity='spot': disagrees"):
        SliceFields(spot="true").against(RECORDED, CLUSTER)
    spot = TpuSlice("v6e", "2x4", num_slices=2, chips_per_host=4, capacity="spot")
    assert SliceFields(spot=True).against(spot, CLUSTER) is spot


def test_a_cluster_that_records_no_slice_needs_the_whole_shape() -> None:
    with pytest.raises(FatalError, match="RayCluster ml/train does not exist or records no slice shape; create it "
                                         "with CreateRayClusterOperator, or pass accelerator and topology"):
        SliceFields(topology="2x4").against(None, CLUSTER)
    assert SliceFields(accelerator="v6e", topology="2x4", chips_per_host=4).against(None, CLUSTER) == TpuSlice(
        "v6e", "2x4", chips_per_host=4)


def test_a_capacity_list_is_for_the_create_task_only() -> None:
    assert [str(kind) for kind in SliceFields(capacity="reservation:r1, spot").capacities()] == [
        "reservation:r1", "spot"]
    with pytest.raises(InvalidInputError, match="lists capacities to try in order, which only "
                                                "CreateRayClusterOperator does. Write one capacity"):
        DeployRayServiceOperator(task_id="deploy", applications=[], accelerator="v6e", topology="4x4",
                                 capacity=["reservation:r1", "spot"])
    with pytest.raises(InvalidInputError, match="spot/capacity"), pytest.warns(AirflowProviderDeprecationWarning):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", spot=True,
                                 capacity=["reservation:r1", "on-demand"], fallback_after=60)


@pytest.mark.parametrize("make", [
    lambda: CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", spot=True),
    lambda: CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", spot="{{ params.spot }}"),
    lambda: DeployRayServiceOperator(task_id="deploy", applications=[], accelerator="v6e", topology="4x4",
                                     spot="true"),
    lambda: JaxTrainerOperator(**TRAIN, spot=True),
])
def test_spot_still_works_and_warns_naming_capacity(make: Any) -> None:
    with pytest.warns(AirflowProviderDeprecationWarning, match="spot is deprecated: write capacity='spot'"):
        task = make()
    if "{{" not in str(task.spot):
        assert [str(kind) for kind in SliceFields.of(task).capacities()] == ["spot"]


def test_the_default_spot_does_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", capacity="spot")
    JaxTrainerOperator(**TRAIN, elastic_slices=(1, 2))
    assert not [w for w in recwarn if issubclass(w.category, AirflowProviderDeprecationWarning)]


def test_a_range_as_num_slices_still_trains_elastically_and_warns_naming_elastic_slices() -> None:
    with pytest.warns(AirflowProviderDeprecationWarning, match=r"num_slices=\(min, max\) is deprecated: write "
                                                               r"elastic_slices=\(min, max\)"):
        task = JaxTrainerOperator(**TRAIN, num_slices=(1, 2))
    assert (task.num_slices, task.elastic_slices) == (None, (1, 2))
    with pytest.raises(InvalidInputError, match="num_slices=.1, 2.: is a range, and elastic_slices=.1, 2. is given "
                                                "too. Give the range as elastic_slices only"), \
            pytest.warns(AirflowProviderDeprecationWarning):
        JaxTrainerOperator(**TRAIN, num_slices=[1, 2], elastic_slices=[1, 2])
