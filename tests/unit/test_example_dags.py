"""Every example DAG parses in Airflow without import errors, with teardowns and UI params."""

from __future__ import annotations

from pathlib import Path

from airflow.dag_processing.dagbag import DagBag

EXAMPLES = Path(__file__).parents[2] / "example_dags"


def test_example_dags_parse() -> None:
    bag = DagBag(dag_folder=str(EXAMPLES))
    assert bag.import_errors == {}
    assert {"tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings", "tpu_model_serving"} <= set(bag.dag_ids)
    for dag_id in ("tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings"):
        dag = bag.dags[dag_id]
        assert dag.get_task("delete_cluster").is_teardown, dag_id
    for dag_id in ("nightly_finetune", "nightly_embeddings"):
        params = bag.dags[dag_id].params
        assert {"accelerator", "topology", "slices", "spot"} <= set(params), dag_id
        assert bag.dags[dag_id].default_args["retries"] >= 1


def test_finetune_tears_down_the_training_cluster_after_training() -> None:
    dag = DagBag(dag_folder=str(EXAMPLES / "nightly_finetune.py")).dags["nightly_finetune"]
    delete = dag.get_task("delete_cluster")
    assert {t.task_id for t in delete.upstream_list} == {"train", "create_cluster"}
    assert [t.task_id for t in dag.get_task("promote_model").downstream_list] == ["wait_serving"]
