"""Every example DAG parses in Airflow without import errors."""

from __future__ import annotations

from pathlib import Path

from airflow.dag_processing.dagbag import DagBag

EXAMPLES = Path(__file__).parents[2] / "example_dags"


def test_example_dags_parse() -> None:
    bag = DagBag(dag_folder=str(EXAMPLES))
    assert bag.import_errors == {}
    assert "tpu_cluster_lifecycle" in bag.dag_ids
    teardown = bag.dags["tpu_cluster_lifecycle"].get_task("delete_cluster")
    assert teardown.is_teardown
