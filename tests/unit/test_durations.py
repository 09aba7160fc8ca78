"""One convention for every duration a DAG author gives: a ``timedelta`` or a number of seconds, named for what it
is (no unit in the name); a renamed duration's old name still counts, and warns."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from typing import Any

import pytest
from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.ray_data import RayDataOperator
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.operators.raycluster import (
    CreateRayClusterOperator,
    DeleteExpiredRayClustersOperator,
    DeleteRayClusterOperator,
)
from airflow_provider_raytpu.operators.rayservice import (
    DeleteRayServiceOperator,
    DeployRayServiceOperator,
    RollbackRayServiceOperator,
)
from airflow_provider_raytpu.operators.run_report import RunReportOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor
from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

JOB = {"cluster_name": "c"}
#: Every operator and sensor a DAG author writes, with the least it needs.
TASKS: dict[type, dict[str, Any]] = {
    SubmitRayJobOperator: {**JOB, "entrypoint": "python job.py"},
    RayDataOperator: {**JOB, "input_uri": "gs://b/in", "output_uri": "gs://b/out", "transform": "m:f"},
    JaxTrainerOperator: {**JOB, "train_loop": "m:f", "checkpoint_uri": "gs://b/c"},
    CreateRayClusterOperator: {"accelerator": "v6e", "topology": "2x2", "capacity": ["reservation:r1", "spot"],
                               "fallback_after": 600},
    DeleteRayClusterOperator: {},
    DeleteExpiredRayClustersOperator: {},
    DeployRayServiceOperator: {"applications": [], "accelerator": "v6e", "topology": "2x2"},
    RollbackRayServiceOperator: {"service_name": "s"},
    DeleteRayServiceOperator: {},
    RunReportOperator: {"report_uri": "gs://b/reports"},
    RayClusterReadySensor: {"cluster_name": "c"},
    RayServiceRunningSensor: {"service_name": "s"},
}
DURATION = re.compile(r"(timeout|interval|grace_period|delay|lifetime|_after)(_seconds)?$")


def durations(task: type) -> list[str]:
    """The duration parameters of a task class and its bases' ``__init__``."""
    names = {name for cls in task.__mro__ if cls.__module__.startswith("airflow_provider_raytpu")
             for name in inspect.signature(cls.__init__).parameters if DURATION.search(name)}
    return sorted(names)


def seconds(value: Any) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def test_every_task_class_is_listed() -> None:
    from airflow_provider_raytpu.get_provider_info import get_provider_info

    info = get_provider_info()
    modules = [module for kind in ("operators", "sensors") for entry in info[kind]
               for module in entry["python-modules"]]
    listed = {f"{task.__module__}.{task.__name__}" for task in TASKS}
    for module in modules:
        for name, value in vars(__import__(module, fromlist=["_"])).items():
            if inspect.isclass(value) and value.__module__ == module and name.endswith(("Operator", "Sensor")):
                assert f"{module}.{name}" in listed, f"{name}: add it to TASKS"


@pytest.mark.parametrize("task", TASKS, ids=lambda task: task.__name__)
def test_a_duration_is_a_timedelta_or_seconds_and_its_name_has_no_unit(task: type) -> None:
    for name in durations(task):
        assert not name.endswith("_seconds"), f"{task.__name__}({name}=...): name the duration, not its unit"
        annotation = next(str(cls.__init__.__annotations__[name]) for cls in task.__mro__
                          if name in getattr(cls.__init__, "__annotations__", {}))
        assert "timedelta" in annotation and "float" in annotation, f"{task.__name__}({name}: {annotation})"
        given = {**TASKS[task], name: timedelta(seconds=90)}
        as_timedelta = task(task_id="t", **given)
        as_seconds = task(task_id="t", **{**given, name: 90})
        assert seconds(getattr(as_timedelta, name)) == seconds(getattr(as_seconds, name)) == 90.0, name


def test_the_check_finds_every_duration_the_docs_name() -> None:
    assert durations(JaxTrainerOperator) == ["cluster_ready_timeout", "poll_interval", "resize_interval",
                                             "unreachable_grace_period"]
    assert durations(CreateRayClusterOperator) == ["fallback_after", "max_lifetime"]
    assert durations(DeployRayServiceOperator) == ["cluster_deletion_delay"]
    assert durations(RayServiceRunningSensor) == ["deploying_timeout", "grace_period", "poke_interval", "smoke_timeout",
                                                  "timeout"]


@pytest.mark.parametrize(("given", "said"), [
    ({"poll_interval": "2s"}, "poll_interval='2s': is not a duration. Give a timedelta, e.g. 2, or a number of "
                              "seconds"),
    ({"cluster_ready_timeout": -1}, "cluster_ready_timeout=datetime.timedelta(days=-1, seconds=86399): is not "
                                    "longer than zero"),
    ({"unreachable_grace_period": timedelta(seconds=-5)}, "is shorter than zero"),
])
def test_a_duration_that_is_not_one_names_the_field(given: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        SubmitRayJobOperator(task_id="t", **TASKS[SubmitRayJobOperator], **given)
    assert said in str(info.value)


def test_cluster_deletion_delay_seconds_still_counts_and_warns() -> None:
    args = {"task_id": "deploy", **TASKS[DeployRayServiceOperator]}
    with pytest.warns(AirflowProviderDeprecationWarning, match="cluster_deletion_delay_seconds is deprecated: "
                                                               "write cluster_deletion_delay"):
        older = DeployRayServiceOperator(**args, cluster_deletion_delay_seconds=120)
    assert older.cluster_deletion_delay == DeployRayServiceOperator(
        **args, cluster_deletion_delay=timedelta(minutes=2)).cluster_deletion_delay == 120.0
    with pytest.raises(InvalidInputError, match="cluster_deletion_delay_seconds=120: is given with "
                                                "cluster_deletion_delay=60"), \
            pytest.warns(AirflowProviderDeprecationWarning):
        DeployRayServiceOperator(**args, cluster_deletion_delay_seconds=120, cluster_deletion_delay=60)
