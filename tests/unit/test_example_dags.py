"""Every example DAG parses in Airflow without import errors, with teardowns and UI params."""

from __future__ import annotations

from pathlib import Path

from airflow.dag_processing.dagbag import DagBag

EXAMPLES = Path(__file__).parents[2] / "example_dags"


def test_example_dags_parse() -> None:
    bag = DagBag(dag_folder=str(EXAMPLES))
    assert bag.import_errors == {}
    assert {"tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings", "tpu_model_serving",
            "after_promotion"} <= set(bag.dag_ids)
    for dag_id in ("tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings"):
        dag = bag.dags[dag_id]
        delete = dag.get_task("delete_cluster")
        assert delete.is_teardown and delete.cluster_name is None and delete.cluster is None, (
            f"{dag_id}: the teardown needs no XCom")
        assert delete.trigger_rule == "all_done", f"{dag_id}: the teardown runs even when create failed"
        # A Clear of any task re-runs both setups: the cluster is created again AND waited for.
        setups = {t.task_id for t in delete.upstream_list if t.is_setup}
        assert {"create_cluster", next(t for t in setups if t.startswith("wait"))} == setups, dag_id
    for dag_id in ("nightly_finetune", "nightly_embeddings"):
        params = bag.dags[dag_id].params
        assert {"accelerator", "topology", "slices", "capacity"} <= set(params), dag_id
        assert bag.dags[dag_id].default_args["retries"] >= 1


def test_unpausing_an_example_starts_no_expensive_run() -> None:
    """The default params are the smallest slice that shows each feature; runs that write the same
    output (or promote the same RayService) do not overlap."""
    from airflow_provider_raytpu.tpu import TpuSlice

    bag = DagBag(dag_folder=str(EXAMPLES))
    chips = {}
    for dag_id in ("tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings"):
        params = bag.dags[dag_id].params
        tpu = TpuSlice(params["accelerator"], params["topology"], params["slices"])
        chips[dag_id] = tpu.total_hosts * tpu.host_chips
    assert chips == {"tpu_cluster_lifecycle": 4, "nightly_finetune": 8, "nightly_embeddings": 8}
    for dag_id in ("nightly_finetune", "nightly_embeddings", "tpu_model_serving", "tpu_llm_serving"):
        assert bag.dags[dag_id].max_active_runs == 1, dag_id


def test_finetune_tears_down_the_training_cluster_after_training() -> None:
    dag = DagBag(dag_folder=str(EXAMPLES / "nightly_finetune.py")).dags["nightly_finetune"]
    delete = dag.get_task("delete_cluster")
    assert {t.task_id for t in delete.upstream_list} == {"train", "create_cluster", "wait_cluster_ready"}
    assert [t.task_id for t in dag.get_task("promote_model").downstream_list] == ["wait_serving"]


def test_finetune_reports_last_without_making_a_cluster_to_report() -> None:
    """The run report comes after everything, as a teardown (the run's state stays with its work); it has no
    setup, so a Clear of the promotion (the UI's default: with downstream) re-promotes and re-reports without
    creating a training cluster, while a Clear of training makes one again and reports that."""
    dag = DagBag(dag_folder=str(EXAMPLES / "nightly_finetune.py")).dags["nightly_finetune"]
    report = dag.get_task("run_report")
    assert report.is_teardown and report.trigger_rule == "all_done"
    assert {t.task_id for t in report.upstream_list} == {"delete_cluster", "wait_serving"}

    def cleared(task_id: str) -> set[str]:
        return set(dag.partial_subset(task_ids=[task_id], include_downstream=True, include_upstream=False).task_ids)

    assert cleared("promote_model") == {"promote_model", "wait_serving", "run_report"}
    assert cleared("train") == {"create_cluster", "wait_cluster_ready", "train", "delete_cluster", "promote_model",
                                "wait_serving", "run_report"}


def test_after_promotion_runs_on_the_model_nightly_finetune_serves() -> None:
    bag = DagBag(dag_folder=str(EXAMPLES))
    finetune, after = bag.dags["nightly_finetune"], bag.dags["after_promotion"]
    (served,) = finetune.get_task("wait_serving").outlets
    assert list(after.timetable.asset_condition.objects) == [served]
    assert [a.name for a in finetune.get_task("train").outlets] == ["finetuned_regressor_checkpoints"]
    assert not after.get_task("record_promotion").outlets
