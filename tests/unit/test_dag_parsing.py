"""What Airflow's DAG processor sees: mistakes in literals are import errors, run-time values parse.

Each DAG is written to a file and parsed by Airflow's own DagBag, as the DAG processor does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag

HEADER = '''
from datetime import datetime
from airflow.sdk import DAG, task
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.ray_data import RayDataOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator, RollbackRayServiceOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor
from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

APPS = [{"name": "m", "import_path": "serving.model:build_app", "version_arg": "model_version"}]
'''


def parse(tmp_path: Path, body: str) -> DagBag:
    path = tmp_path / "dag.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return DagBag(dag_folder=str(path))


def import_error(bag: DagBag) -> str:
    (error,) = bag.import_errors.values()
    return error


@pytest.mark.parametrize("operator", [
    "CreateRayClusterOperator(task_id='create', accelerator='v6e', topology='16')",
    "DeployRayServiceOperator(task_id='deploy', applications=APPS, version='v1', accelerator='v6e', topology='16')",
    "JaxTrainerOperator(task_id='train', cluster_name='c', train_loop='m:f', checkpoint_uri='gs://b/c', "
    "accelerator='v6e', topology='16')",
], ids=["create", "deploy", "train"])
def test_a_literal_slice_shape_is_checked_when_the_dag_is_parsed(tmp_path: Path, operator: str) -> None:
    bag = parse(tmp_path, f'''
        with DAG("literal_shape", schedule=None, start_date=datetime(2026, 1, 1)):
            {operator}
    ''')
    assert "topology='16': topology is a slice shape such as '4x4', not a chip count" in import_error(bag)


def test_templated_slice_fields_and_uris_parse_and_are_checked_at_run_time(tmp_path: Path) -> None:
    bag = parse(tmp_path, '''
        with DAG("runtime_values", schedule=None, start_date=datetime(2026, 1, 1), params={"topology": "16"}):
            create = CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="{{ params.topology }}")

            @task
            def where() -> dict:
                return {"features": "gs://b/features", "checkpoints": "gs://b/ckpt"}

            uris = where()
            prep = RayDataOperator(task_id="prep", cluster=create.output, input_uri="gs://b/raw",
                                   output_uri=uris["features"], transform="m:f")
            train = JaxTrainerOperator(task_id="train", cluster=create.output, train_loop="m:f",
                                       checkpoint_uri=uris["checkpoints"], datasets={"eval": prep.output["output_uri"]})
            literal = RayDataOperator(task_id="literal", cluster=create.output, input_uri="gs://b/raw",
                                      output_uri="gs://b/out/{{ ds }}", transform="m:f")
    ''')
    assert bag.import_errors == {}
    dag = bag.dags["runtime_values"]
    assert dag.get_task("prep").outlets == [] and dag.get_task("literal").outlets == []
    # The reference made the dependencies: no template to write, no edge to draw.
    assert dag.get_task("create").task_id in dag.get_task("train").upstream_task_ids


def test_both_sensors_take_airflows_poke_interval(tmp_path: Path) -> None:
    bag = parse(tmp_path, '''
        with DAG("poke_interval", schedule=None, start_date=datetime(2026, 1, 1)):
            create = CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2")
            RayClusterReadySensor(task_id="ready", cluster=create.output, poke_interval=30, mode="reschedule")
            RayServiceRunningSensor(task_id="running", service_name="chat", poke_interval=45, mode="reschedule")
            RayServiceRunningSensor(task_id="old_name", service_name="chat", poll_interval=5)
    ''')
    assert bag.import_errors == {}
    dag = bag.dags["poke_interval"]
    assert [dag.get_task(t).poke_interval for t in ("ready", "running", "old_name")] == [30, 45, 5]


def test_the_teardown_and_the_rollback_need_no_spec(tmp_path: Path) -> None:
    bag = parse(tmp_path, '''
        with DAG("no_spec", schedule=None, start_date=datetime(2026, 1, 1)):
            create = CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2")
            delete = DeleteRayClusterOperator(task_id="delete")
            create >> delete.as_teardown(setups=create)
            RollbackRayServiceOperator(task_id="rollback", service_name="chat")
    ''')
    assert bag.import_errors == {}
    delete = bag.dags["no_spec"].get_task("delete")
    assert delete.is_teardown and delete.trigger_rule == "all_done"


def test_deferrable_follows_airflows_default_deferrable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = '''
        with DAG("deferrable", schedule=None, start_date=datetime(2026, 1, 1)):
            RayClusterReadySensor(task_id="ready", cluster_name="c")
            RayServiceRunningSensor(task_id="running", service_name="chat")
            JaxTrainerOperator(task_id="train", cluster_name="c", train_loop="m:f", checkpoint_uri="gs://b/c")
            RayClusterReadySensor(task_id="explicit", cluster_name="c", deferrable=True)
    '''
    for setting, expected in (("False", False), ("True", True)):
        monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", setting)
        dag = parse(tmp_path, body).dags["deferrable"]
        assert {t.task_id: t.deferrable for t in dag.tasks} == {
            "ready": expected, "running": expected, "train": expected, "explicit": True}
