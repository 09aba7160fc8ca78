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
            JaxTrainerOperator(task_id="elastic", cluster=create.output, train_loop="m:f", checkpoint_uri="gs://b/c",
                               accelerator="v4", topology="2x2x2", elastic_slices=(1, 2))
            JaxTrainerOperator(task_id="elastic_later", cluster=create.output, train_loop="m:f",
                               checkpoint_uri="gs://b/c", elastic_slices="{{ params.slices }}")
            JaxTrainerOperator(task_id="stated_later", cluster=create.output, train_loop="m:f",
                               checkpoint_uri="gs://b/c", capacity="{{ params.capacity }}", topology="2x2x2")
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
    ''')
    assert bag.import_errors == {}
    dag = bag.dags["poke_interval"]
    assert [dag.get_task(t).poke_interval for t in ("ready", "running")] == [30, 45]


def test_a_sensors_poll_interval_still_counts_and_warns_naming_poke_interval() -> None:
    from airflow.exceptions import AirflowProviderDeprecationWarning

    from airflow_provider_raytpu.errors import InvalidInputError
    from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor
    from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

    with pytest.warns(AirflowProviderDeprecationWarning, match="poll_interval is deprecated: write poke_interval"):
        old = RayServiceRunningSensor(task_id="old_name", service_name="chat", poll_interval=5)
    assert old.poke_interval == 5
    with pytest.warns(AirflowProviderDeprecationWarning), pytest.raises(InvalidInputError, match="poll_interval=2"):
        RayClusterReadySensor(task_id="both", cluster_name="c", poke_interval=1, poll_interval=2)


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


@pytest.mark.parametrize(("input_uri", "output_uri", "said"), [
    ("gs://b/raw", "gs://b/raw/", "output_uri='gs://b/raw/': is the same location as the input 'gs://b/raw'"),
    ("gs://b/raw/2026", "gs://b/raw", "output_uri='gs://b/raw': contains the input 'gs://b/raw/2026'"),
    ("~/data", "~/data/clean", "output_uri='~/data/clean': lies inside the input '~/data'"),
])
def test_an_output_over_its_input_is_an_import_error(tmp_path: Path, input_uri: str, output_uri: str,
                                                     said: str) -> None:
    bag = parse(tmp_path, f'''
        with DAG("overlap", schedule=None, start_date=datetime(2026, 1, 1)):
            RayDataOperator(task_id="clean", cluster_name="c", input_uri={input_uri!r}, output_uri={output_uri!r},
                            transform="m:f")
    ''')
    assert said + ". Replacing an output deletes what is there" in import_error(bag)


@pytest.mark.parametrize(("lifetime", "said"), [
    ("-5", "max_lifetime=datetime.timedelta(days=-1, seconds=86395): is not longer than zero"),
    ("timedelta(0)", "max_lifetime=datetime.timedelta(0): is not longer than zero"),
    ("'24h'", "max_lifetime='24h': is not a duration. Give a timedelta, e.g. timedelta(hours=24), "
              "or a number of seconds"),
])
def test_a_bad_max_lifetime_is_an_import_error(tmp_path: Path, lifetime: str, said: str) -> None:
    bag = parse(tmp_path, f'''
        from datetime import timedelta
        with DAG("lifetime", schedule=None, start_date=datetime(2026, 1, 1)):
            CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2", max_lifetime={lifetime})
    ''')
    assert said in import_error(bag)


def test_max_lifetime_in_seconds_is_a_duration(tmp_path: Path) -> None:
    from datetime import timedelta

    bag = parse(tmp_path, '''
        with DAG("lifetime_seconds", schedule=None, start_date=datetime(2026, 1, 1)):
            CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2", max_lifetime=3600)
    ''')
    assert bag.dags["lifetime_seconds"].task_dict["create"].max_lifetime == timedelta(hours=1)


JOB = "cluster_name='c', "


@pytest.mark.parametrize(("operator", "said"), [
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', num_slices=100000)",
     "num_slices=100000: is more than 256"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', "
     "cluster_options={'labels': {'team': 'ml platform'}})",
     "labels['team']='ml platform': is not a label value"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', "
     "cluster_options={'env': {'A': None}})",
     "env['A']=None: is not a string (or a number)"),
    ("DeployRayServiceOperator(task_id='t', applications=APPS, version='v1', accelerator='v6e', topology='2x2', "
     "cluster_options={'annotations': {'Not A Key': 'x'}})", "annotations['Not A Key']='x': has a name part"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='nocolon', checkpoint_uri='gs://b/c')",
     "train_loop='nocolon': is not an import path. Write 'package.module:name'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='')",
     "checkpoint_uri='': is empty. Give it, e.g. 'gs://bucket/checkpoints'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='   ')",
     "checkpoint_uri='   ': is empty. Give it, e.g. 'gs://bucket/checkpoints'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='not.a.module:fn', checkpoint_uri='gs://b/c')",
     "train_loop='not.a.module:fn': is not an import path. Write 'package.module:name'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='mod:1fn', checkpoint_uri='gs://b/c')",
     "train_loop='mod:1fn': is not an import path"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', "
     "cluster_options={'env': {'A=B': 'x'}})",
     "env='A=B': is not an environment variable name"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', max_lifetime=float('nan'))",
     "max_lifetime=nan: is not a finite number of seconds (at most 100 years). Give e.g. timedelta(hours=24)"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', max_lifetime=float('inf'))",
     "max_lifetime=inf: is not a finite number of seconds"),
    ("CreateRayClusterOperator(task_id='t', accelerator='v6e', topology='2x2', max_lifetime=1e12)",
     "max_lifetime=1000000000000.0: is not a finite number of seconds"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', num_slices=(2, 1))",
     "num_slices=(2, 1): asks for at least 2 slices but at most 1. Write a slice count such as 2, or a range "
     "(min, max) such as (1, 2)"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', num_slices=[0, 2])",
     "num_slices=[0, 2]: has a bound that must be at least 1"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', elastic_slices=(1, 2), "
     "accelerator='v4', topology='2x2x3')", "topology='2x2x3'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', elastic_slices=(2, 1))",
     "elastic_slices=(2, 1): asks for at least 2 slices but at most 1"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', elastic_slices=2)",
     "elastic_slices=2: is not a (min, max) range of slices. Write e.g. (1, 2); to state the cluster's slice count, "
     "write num_slices"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', capacity='spott')",
     "capacity='spott': is not a capacity"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', accelerator='v9')",
     "accelerator='v9'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', num_slices='two')",
     "num_slices='two'"),
    ("JaxTrainerOperator(task_id='t', " + JOB + "train_loop='m:f', checkpoint_uri='gs://b/c', resize_interval='1m')",
     "resize_interval='1m': is not a duration. Give a timedelta, e.g. 60 (Ray Train's default), or a number of "
     "seconds"),
    ("RayDataOperator(task_id='t', " + JOB + "input_uri='gs://b/in', output_uri='gs://b/out', transform='m.f')",
     "transform='m.f': is not an import path"),
    ("SubmitRayJobOperator(task_id='t', " + JOB + "entrypoint='')", "entrypoint='': is empty"),
    ("SubmitRayJobOperator(task_id='t', " + JOB + "entrypoint=[])", "entrypoint=[]: is empty"),
    ("DeployRayServiceOperator(task_id='t', applications=APPS, version='v1', accelerator='v6e', topology='2x2', "
     "upgrade_strategy='Blue')", "upgrade_strategy='Blue': is not a KubeRay v1.5 upgrade strategy"),
])
def test_values_that_used_to_fail_late_fail_when_the_dag_is_parsed(tmp_path: Path, operator: str, said: str) -> None:
    bag = parse(tmp_path, f'''
        from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
        with DAG("late", schedule=None, start_date=datetime(2026, 1, 1)):
            {operator}
    ''')
    assert said in import_error(bag)


def test_templated_values_of_those_fields_parse(tmp_path: Path) -> None:
    bag = parse(tmp_path, '''
        from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
        with DAG("late_ok", schedule=None, start_date=datetime(2026, 1, 1), params={"team": "ml"}):
            CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2",
                                     cluster_options={"labels": {"team": "{{ params.team }}"},
                                                      "env": {"RUN": "{{ run_id }}"}})
            SubmitRayJobOperator(task_id="job", cluster_name="c", entrypoint="{{ params.team }}")
    ''')
    assert not bag.import_errors


GKE = '{"conn_type": "raytpu", "extra": {"backend": "gke", "project_id": "p", "location": "l", "cluster": "c"}}'


@pytest.mark.parametrize("connection", [GKE, "raytpu://?backend=gke&project_id=p&location=l&cluster=c", None])
def test_parsing_does_not_depend_on_where_the_connection_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                connection: str | None) -> None:
    """Whether GKE offers a shape depends on the connection's backend: checked when the task runs (before anything
    is created), so the same file parses alike with the connection in the environment or in the database."""
    if connection:
        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", connection)
    bag = parse(tmp_path, '''
        with DAG("v6e_2x8", schedule=None, start_date=datetime(2026, 1, 1)):
            CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x8")
    ''')
    assert not bag.import_errors


def test_a_shape_gke_does_not_offer_parses_on_kubernetes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_OWN", '{"conn_type": "raytpu", "extra": {"backend": "kubernetes"}}')
    bag = parse(tmp_path, '''
        with DAG("own_nodes", schedule=None, start_date=datetime(2026, 1, 1)):
            CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x8", raytpu_conn_id="raytpu_own")
            CreateRayClusterOperator(task_id="v7x_1", accelerator="v7x", topology="1x1x1", raytpu_conn_id="raytpu_own")
            CreateRayClusterOperator(task_id="v5p_28", accelerator="v5p", topology="4x4x28",
                                     raytpu_conn_id="raytpu_own")
    ''')
    assert not bag.import_errors
