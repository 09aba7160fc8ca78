"""Ray job identity: deterministic per task try; retries versus a user's Clear."""

from __future__ import annotations

from types import SimpleNamespace

from airflow_provider_raytpu.hooks.ray_jobs import JobIdentity
from airflow_provider_raytpu.tasks.job_tries import same_cycle, will_be_retried
from airflow_provider_raytpu.workloads.result import last_result, report_result


class TaskStateStore(dict):
    """Airflow's task state store as a task sees it (``context["task_state_store"]``: get, and set with a
    retention), one per DAG run: a run deleted and created again starts with an empty one."""

    def get(self, key: str, default: object = None) -> object:
        return super().get(key, default)

    def set(self, key: str, value: object, *, retention: object = None) -> None:
        self[key] = value


def test_submission_id_is_deterministic_per_try() -> None:
    first = JobIdentity("dag", "train", "manual__1", -1, 1)
    assert first.submission_id == JobIdentity("dag", "train", "manual__1", -1, 1).submission_id
    assert first.submission_id != JobIdentity("dag", "train", "manual__1", -1, 2).submission_id
    assert first.task_key == JobIdentity("dag", "train", "manual__1", -1, 2).task_key
    assert first.task_key != JobIdentity("dag", "train", "manual__1", 0, 1).task_key
    assert first.metadata()["raytpu.try_number"] == "1"
    recreated = JobIdentity("dag", "train", "manual__1", -1, 1, run_token="another")
    assert recreated.task_key != first.task_key, "a DAG run created again with the same run id is another run"


def context(try_number: int, max_tries: int) -> dict:
    return {"ti": SimpleNamespace(try_number=try_number, max_tries=max_tries)}


def job_of(try_number: int, max_tries: int | None) -> SimpleNamespace:
    """A job as Ray lists it, with the metadata the try that submitted it recorded."""
    metadata = {"raytpu.try_number": str(try_number)}
    if max_tries is not None:
        metadata["raytpu.max_tries"] = str(max_tries)
    return SimpleNamespace(metadata=metadata)


def test_retries_go_on_with_their_cycles_job() -> None:
    # retries=2: tries 1..3 share max_tries=2.
    assert JobIdentity("d", "t", "r", -1, 1, 2).metadata()["raytpu.max_tries"] == "2"
    assert same_cycle(job_of(1, 2), context(2, 2)) and same_cycle(job_of(2, 2), context(3, 2))


def test_a_clear_starts_a_new_cycle() -> None:
    # Cleared after try 3: Airflow sets max_tries = 3 + retries, the next try is 4.
    assert not same_cycle(job_of(3, 2), context(4, 5))
    assert same_cycle(job_of(4, 5), context(5, 5))


def test_lowering_retries_mid_run_does_not_make_a_retry_look_like_a_clear() -> None:
    """retries was 3 when the run began (max_tries=3); the DAG file now says 1. Try 2 is still a retry:
    nothing here reads the task's retries, only what Airflow recorded on the task instance."""
    assert same_cycle(job_of(1, 3), context(2, 3))
    from airflow_provider_raytpu.operators.jax_trainer import run_name_of

    ti = {"dag_id": "nightly", "run_id": "r1", "task_id": "train", "map_index": -1}
    store = TaskStateStore()
    first, retry = ({"ti": SimpleNamespace(**ti, try_number=n, max_tries=3), "task_state_store": store}
                    for n in (1, 2))
    assert run_name_of(first) == run_name_of(retry), "the retry resumes the first try's checkpoints"


def test_a_job_from_an_earlier_release_is_taken_as_this_cycles() -> None:
    assert same_cycle(job_of(1, None), context(2, 2))


def test_whether_a_failed_try_is_retried_is_airflows_rule() -> None:
    assert will_be_retried(context(1, 2)) and will_be_retried(context(2, 2))
    assert not will_be_retried(context(3, 2)) and not will_be_retried(context(1, 0))


def test_result_line_round_trip(capsys) -> None:
    report_result({"rows": 3})
    report_result({"rows": 4, "uri": "gs://b/p"})
    logs = "noise\n" + capsys.readouterr().out + "more noise\n"
    assert last_result(logs) == {"rows": 4, "uri": "gs://b/p"}
    assert last_result("nothing here") is None


def test_default_cluster_name_is_one_per_dag_run_and_task_and_valid() -> None:
    from airflow_provider_raytpu.operators.raycluster import default_cluster_name

    def name(dag_id: str, run_id: str, task_id: str = "create_cluster", map_index: int = -1,
             deployment: str = "prod") -> str:
        return default_cluster_name({"ti": SimpleNamespace(dag_id=dag_id, run_id=run_id, task_id=task_id,
                                                           map_index=map_index)}, deployment)

    run = "scheduled__2026-12-02T00:00:00+00:00"
    first = name("nightly_finetune", run)
    assert first.startswith("nightly-finetune-create-cluster-") and len(first) <= 53
    assert first == name("nightly_finetune", run), "the same on every retry"
    others = [name("nightly_finetune", "scheduled__2026-12-03T00:00:00+00:00"),  # another run
              name("nightly.finetune", run), name("Nightly_Finetune", run),  # DAG ids that read the same
              name("nightly_finetune", run, "create_eval_cluster"),  # another create task in the run
              name("nightly_finetune", run, map_index=0),  # a mapped create
              name("nightly_finetune", run, deployment="staging")]  # the same DAG in another Airflow deployment
    assert len({first, *others}) == 7
    # Two DAG ids sharing their first 44 characters (the old default kept only those).
    prefix = "a_very_long_dag_id_shared_by_two_teams_abcdef"
    assert name(prefix + "_a", run) != name(prefix + "_b", run)
    assert all(len(name(prefix * 3 + x, run)) <= 53 for x in "ab")
    assert name("2026_etl", run)[0].isalpha(), "KubeRay's <name>-head-svc must start with a letter"


def test_default_service_name_is_one_per_dag_and_task_across_runs() -> None:
    from airflow_provider_raytpu.operators.rayservice import default_service_name

    def name(dag_id: str, task_id: str = "deploy", run_id: str = "r1", map_index: int | None = -1,
             deployment: str = "prod") -> str:
        return default_service_name({"ti": SimpleNamespace(dag_id=dag_id, task_id=task_id, run_id=run_id,
                                                           map_index=map_index)}, deployment)

    assert name("serving") == name("serving", run_id="r2"), "later runs promote the same RayService"
    assert len({name("serving"), name("serving", "deploy_canary"), name("serv.ing"), name("serv_ing"),
                name("serving", deployment="staging")}) == 5
    assert len(name("x" * 100)) <= 47
    # Each map index of an expanded deploy serves its own applications; an unmapped task keeps its old name.
    assert name("serving", map_index=None) == name("serving") == "serving-deploy-" + name("serving").rsplit("-")[-1]
    mapped = {name("serving", map_index=i) for i in (0, 1)}
    assert len(mapped) == 2 and name("serving") not in mapped
    assert name("serving", map_index=1) == name("serving", run_id="r2", map_index=1)


def test_training_run_name_is_the_same_for_retries_and_new_after_a_clear() -> None:
    from airflow_provider_raytpu.operators.jax_trainer import run_name_of

    store = TaskStateStore()

    def run_name(try_number: int, max_tries: int, resume_on_clear: bool = False,
                 run_store: TaskStateStore = store) -> str:
        ti = SimpleNamespace(dag_id="nightly", run_id="r1", task_id="train", map_index=-1, try_number=try_number,
                             max_tries=max_tries)
        return run_name_of({"ti": ti, "task_state_store": run_store}, resume_on_clear)

    first_cycle = {run_name(1, 2), run_name(2, 2), run_name(3, 2)}
    assert len(first_cycle) == 1 and run_name(1, 2).startswith("nightly.train-")
    after_clear = {run_name(4, 5), run_name(5, 5)}
    assert len(after_clear) == 1 and after_clear != first_cycle
    assert run_name(4, 5, resume_on_clear=True) == run_name(1, 2, resume_on_clear=True)
    # The run deleted and created again with the same run id: another token, never the old checkpoints.
    assert run_name(1, 2, resume_on_clear=True, run_store=TaskStateStore()) != run_name(1, 2, resume_on_clear=True)
    assert len(store) == 1, "one token for the run, made at its first try"
