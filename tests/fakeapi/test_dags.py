"""Real DAG runs (dag.test) against a Kubernetes API over HTTP: create -> ready (deferred) -> delete."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_raytpu.manifests.raycluster import (
    AGENT_PORTS,
    EXPIRES_AT_ANNOTATION,
    format_expiry,
    parse_expiry,
)
from tests.support.airflow_runner import run_dag, task_instances
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.gcs import wait_for
from tests.support.kube_connection import NAMESPACE, raytpu_connection
from tests.support.task_logs import LOADED_SILENCE_LIMIT_SECONDS, captured_output, problems, task_logs

pytestmark = pytest.mark.timeout(120)

LIFECYCLE = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1),
         default_args={{"retries": 2, "retry_delay": 0}},
         params={{"accelerator": Param("v6e"), "topology": Param("4x4"), "slices": Param("1"),
                 "capacity": Param("on-demand")}}):
    create = CreateRayClusterOperator(
        task_id="create_cluster", cluster_name="nightly_train",
        accelerator="{{{{ params.accelerator }}}}", topology="{{{{ params.topology }}}}",
        num_slices="{{{{ params.slices }}}}", capacity="{{{{ params.capacity }}}}",
    )
    cluster = "{{{{ ti.xcom_pull('create_cluster')['cluster_name'] }}}}"
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=cluster, timeout=60, poke_interval=1)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", wait_for_deletion=True)
    create >> ready >> delete.as_teardown(setups=[create, ready])
'''


def test_create_ready_delete_with_ui_string_params(airflow_home: Path, connections: None,
                                                   kube: FakeKubeApiServer) -> None:
    # Slow enough that the sensor defers and the trigger's watch sees the hosts come up.
    with KubeRayReactor(kube, delay=2.0, stagger=0.05):
        outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="lifecycle"), "lifecycle",
                          conf={"accelerator": "TPU-V6E", "topology": "4x4", "slices": "2", "capacity": "on-demand"})
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    reference = outcome["create_cluster"].result
    assert reference == {
        "cluster_name": "nightly-train",
        "namespace": NAMESPACE,
        "raytpu_conn_id": "raytpu_default",
        "tpu": {"accelerator": "v6e", "topology": "4x4", "num_slices": 2, "chips_per_host": None,
                "capacity": "on-demand"},
        "dashboard_url": f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services/nightly-train-head-svc:dashboard/proxy",
    }
    assert outcome["wait_ready"].result["ready_hosts"] == 8
    # The task pages link to the dashboard through the API server's service proxy, the transport in use.
    dashboard = {"Ray dashboard": reference["dashboard_url"] + "/"}
    assert outcome["create_cluster"].links == outcome["wait_ready"].links == dashboard
    assert outcome["delete_cluster"].links == {}
    assert kube.count("GET", r"/rayclusters$", watch=True) >= 1, "the sensor should have deferred to the watch"
    assert kube.get_object("rayclusters", NAMESPACE, "nightly-train") is None
    assert kube.list_objects("v1/pods", NAMESPACE) == []


TEARDOWN = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator

with DAG("teardown", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteRayClusterOperator(task_id="delete_cluster", cluster_name="slow-to-go", poll_interval=1, force=True)
'''


def test_a_teardown_waits_for_the_pods_and_says_so(request: pytest.FixtureRequest, airflow_home: Path,
                                                   connections: None, kube: FakeKubeApiServer) -> None:
    """By default the delete waits until the RayCluster and its pods are gone, logging what is left."""
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    with KubeRayReactor(kube, delay=0.1, stagger=0.01, delete_delay=9.0) as reactor:
        kube.create_object(build_ray_cluster(name="slow-to-go", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x4")))
        assert wait_for(lambda: kube.list_objects("v1/pods", NAMESPACE), 30)
        with captured_output(request.config) as logs:
            outcome = run_dag(airflow_home, TEARDOWN, "teardown")
    if not logs.out:
        pytest.skip("pytest does not capture output (-s): no task log to read")
    assert outcome["delete_cluster"].state == "success" and reactor is not None
    assert (kube.get_object("rayclusters", NAMESPACE, "slow-to-go") is None
            and kube.list_objects("v1/pods", NAMESPACE) == [])
    tasks = task_instances(outcome)
    assert problems(logs.out, logs.err, tasks, limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    (log,) = task_logs(logs.out, tasks)
    said = [line.message for line in log.provider_lines()]
    assert any(m.startswith(f"Waiting for RayCluster {NAMESPACE}/slow-to-go to be gone: the RayCluster is being "
                            "deleted (") for m in said), said
    assert said[-2].startswith(f"RayCluster {NAMESPACE}/slow-to-go and its pods are gone after ")
    assert said[-1].startswith(f"RayCluster {NAMESPACE}/slow-to-go used ")  # its usage (the reactor made it ready)


def test_bad_slice_fails_before_any_api_call(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="bad_slice"), "bad_slice",
                      conf={"accelerator": "v6e", "topology": "16", "slices": "1", "capacity": "on-demand"})
    # Bad input is not retried (retries=2 in the DAG), and nothing reached the API server.
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert kube.count("POST") == 0
    # The teardown runs although its setups failed (a create can fail after applying); it finds nothing.
    assert outcome["delete_cluster"].state == "success"
    assert outcome["delete_cluster"].result["cluster_names"] == [] and kube.count("DELETE") == 0


CAPACITY = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 2, "retry_delay": 0}},
         params={{"capacity": Param("on-demand", type="string")}}):
    CreateRayClusterOperator(task_id="create_cluster", cluster_name="{dag_id}", accelerator="v6e", topology="4x4",
                             capacity="{{{{ params.capacity }}}}")
'''


def test_capacity_chosen_in_the_ui_selects_its_nodes(airflow_home: Path, connections: None,
                                                     kube: FakeKubeApiServer) -> None:
    """A trigger's ``capacity`` param reaches the host pods; a flex-start duration bounds the expiry; a bad one
    fails once, before any API call, naming the forms."""
    started = datetime.now(UTC).replace(microsecond=0)
    runs = {"reserved": "reservation:tpu-owner-1/nightly-v6e", "flex": "flex-start:6h", "typo": "reserve:nightly"}
    outcome = {dag_id: run_dag(airflow_home, CAPACITY.format(dag_id=dag_id), dag_id, conf={"capacity": capacity})
               ["create_cluster"] for dag_id, capacity in runs.items()}
    assert outcome["reserved"].result["tpu"]["capacity"] == "reservation:tpu-owner-1/nightly-v6e"
    reserved = kube.get_object("rayclusters", NAMESPACE, "reserved")
    (group,) = reserved["spec"]["workerGroupSpecs"]
    assert group["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "4x4",
        "cloud.google.com/reservation-name": "nightly-v6e", "cloud.google.com/reservation-affinity": "specific",
        "cloud.google.com/reservation-project": "tpu-owner-1"}
    flex = kube.get_object("rayclusters", NAMESPACE, "flex")
    expiry = parse_expiry(flex["metadata"]["annotations"][EXPIRES_AT_ANNOTATION])
    assert started + timedelta(hours=6) <= expiry <= datetime.now(UTC) + timedelta(hours=6)
    assert (outcome["typo"].state, outcome["typo"].try_number) == ("failed", 1)
    assert kube.get_object("rayclusters", NAMESPACE, "typo") is None


USAGE = '''
from datetime import datetime
from airflow.sdk import DAG, Asset
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("usage", schedule=None, start_date=datetime(2026, 1, 1)):
    create = CreateRayClusterOperator(task_id="create_cluster", cluster_name="usage", accelerator="v6e",
                                      topology="4x4", num_slices=2, capacity="spot")
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=60, poke_interval=1)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster=create.output, poll_interval=0.2,
                                      outlets=[Asset("raytpu://usage")], PRICES)
    create >> ready >> delete.as_teardown(setups=create)
'''


@pytest.mark.parametrize(("task_prices", "connection_prices"), [
    ({"v6e": {"spot": 1.5, "on-demand": 4.0}}, {"v6e": {"spot": 9.9}}),  # the task's own win
    (None, {"v6e": {"spot": 1.5}}),  # else the connection's extras
])
def test_a_teardown_reports_the_chip_hours_from_ready_to_gone_and_their_estimated_cost(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch,
        task_prices: dict[str, Any] | None, connection_prices: dict[str, Any]) -> None:
    """The usage record is the teardown's ``tpu_usage`` XCom and its outlet's asset-event extra; ready is when
    KubeRay first said ready (between the create and the sensor), gone after the delete. The prices are the
    task's, else the connection's."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(chip_hour_prices=connection_prices))
    started = datetime.now(UTC).replace(microsecond=0)
    source = USAGE.replace("PRICES", f"chip_hour_prices={task_prices!r}")
    with KubeRayReactor(kube, delay=1.0, stagger=0.05):
        outcome = run_dag(airflow_home, source, "usage")
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    (usage,) = outcome["delete_cluster"].xcoms["tpu_usage"]
    ready, gone = datetime.fromisoformat(usage["ready_at"]), datetime.fromisoformat(usage["gone_at"])
    assert started <= ready <= gone <= datetime.now(UTC)
    hours = (gone - ready).total_seconds() / 3600
    assert usage["hours"] == pytest.approx(hours, abs=1e-6)
    assert (usage["chips"], usage["capacity"], usage["slices_recreated"]) == (32, "spot", 0)
    assert usage["chip_hours"] == {"spot": pytest.approx(32 * hours, abs=1e-5)}
    assert usage["estimated_cost"] == {"spot": pytest.approx(1.5 * 32 * hours, abs=1e-3)}
    with create_session() as session:
        extra = session.execute(select(AssetEvent.extra).where(AssetEvent.source_dag_id == "usage")
                                .order_by(AssetEvent.id.desc())).first()[0]
    assert extra["tpu_usage"] == [usage]


REPORT = USAGE.replace("from airflow.sdk import DAG, Asset", "from airflow.sdk import DAG, Asset\n"
                       "from airflow_provider_raytpu.operators.run_report import RunReportOperator").replace(
    "    create >> ready >> delete.as_teardown(setups=create)",
    "    report = RunReportOperator(task_id='run_report', report_uri=REPORT_DIR)\n"
    "    create >> ready >> delete.as_teardown(setups=create)\n"
    "    delete >> report.as_teardown()").replace('DAG("usage"', 'DAG("run_report"')


def test_a_run_report_has_the_teardowns_usage_and_the_tasks_spans_as_json_and_png(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, tmp_path: Path) -> None:
    """The report teardown reads the run's XComs and task states through the real task SDK and writes both files
    under ``<report_uri>/<dag_id>/<run_id>``; the DAG run's state stays its work tasks'."""
    source = REPORT.replace("PRICES", "chip_hour_prices={'v6e': {'spot': 1.5}}").replace(
        "REPORT_DIR", repr(str(tmp_path / "reports")))
    with KubeRayReactor(kube, delay=1.0, stagger=0.05):
        outcome = run_dag(airflow_home, source, "run_report")
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "delete_cluster": "success", "run_report": "success"}
    (usage,) = outcome["delete_cluster"].xcoms["tpu_usage"]
    (folder,) = (tmp_path / "reports" / "run_report").iterdir()
    report = json.loads((folder / "run_report.json").read_text())
    assert report == outcome["run_report"].result
    assert outcome["run_report"].links == {"Run report": None}  # a local folder: no console page to open
    assert report["clusters"] == [usage] and usage["slices"] == [{"index": 0, "made_again_at": None},
                                                                 {"index": 1, "made_again_at": None}]
    assert report["totals"]["chip_hours"] == usage["chip_hours"]
    assert report["totals"]["estimated_cost_total"] == pytest.approx(usage["estimated_cost"]["spot"], abs=1e-4)
    tasks = {t["task_id"]: t for t in report["tasks"]}
    assert sorted(tasks) == ["create_cluster", "delete_cluster", "wait_ready"]
    spans = [(datetime.fromisoformat(tasks[t]["start"]), datetime.fromisoformat(tasks[t]["end"]))
             for t in ("create_cluster", "wait_ready", "delete_cluster")]
    assert all(start <= end for start, end in spans) and spans[0][1] <= spans[1][1] <= spans[2][1]
    assert datetime.fromisoformat(usage["ready_at"]) <= spans[1][1]  # the sensor saw the cluster ready
    png = (folder / "run_report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


EXPIRED = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteExpiredRayClustersOperator

with DAG("janitor", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteExpiredRayClustersOperator(task_id="delete_expired")
'''


def test_expired_clusters_are_deleted(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    now = datetime.now(UTC)
    for name, expiry in (("old", now - timedelta(minutes=1)), ("fresh", now + timedelta(hours=1))):
        kube.create_object(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                             expires_at=expiry))
    unmanaged = build_ray_cluster(name="unmanaged", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"))
    unmanaged["metadata"]["labels"] = {}
    unmanaged["metadata"]["annotations"][EXPIRES_AT_ANNOTATION] = format_expiry(now - timedelta(days=1))
    kube.create_object(unmanaged)
    garbled = build_ray_cluster(name="garbled", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"))
    garbled["metadata"]["annotations"][EXPIRES_AT_ANNOTATION] = "next tuesday"
    kube.create_object(garbled)
    outcome = run_dag(airflow_home, EXPIRED, "janitor")
    assert outcome["delete_expired"].result == [f"{NAMESPACE}/old"], "one bad annotation skips one cluster, not all"
    assert sorted(c["metadata"]["name"] for c in kube.list_objects("rayclusters", NAMESPACE)) == [
        "fresh", "garbled", "unmanaged"]


NIGHTLY = '''
from datetime import datetime, timedelta
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("nightly_expiry", schedule=None, start_date=datetime(2026, 1, 1)):
    CreateRayClusterOperator(task_id="create_cluster", cluster_name="nightly", accelerator="v6e", topology="2x2",
                             max_lifetime=3600)
'''


def test_expiry_never_kills_live_work(airflow_home: Path, connections: None, kube: FakeKubeApiServer,
                                     kuberay: KubeRayReactor, capfd: pytest.CaptureFixture[str]) -> None:
    """A cluster whose expiry passed is kept while its DAG run runs; a Clear the next day that adopts it renews
    its expiry, so the sweep does not delete it mid-run."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import update

    logical_date = datetime(2026, 12, 3, tzinfo=UTC)
    first = run_dag(airflow_home, NIGHTLY, "nightly_expiry", logical_date=logical_date)
    assert first["create_cluster"].state == "success"
    yesterday = format_expiry(datetime.now(UTC) - timedelta(hours=1))
    kube.patch_object("rayclusters", NAMESPACE, "nightly", {"metadata": {"annotations": {
        EXPIRES_AT_ANNOTATION: yesterday}}})
    run_id = f"manual__{logical_date.isoformat()}"
    with create_session() as session:  # the run goes on (its training is not done)
        session.execute(update(DagRun).where(DagRun.dag_id == "nightly_expiry", DagRun.run_id == run_id)
                        .values(state="running"))
    assert run_dag(airflow_home, EXPIRED, "janitor")["delete_expired"].result == []
    assert (f"RayCluster {NAMESPACE}/nightly expired at {yesterday} but is not deleted: its DAG run nightly_expiry "
            f"/ {run_id} is running") in capfd.readouterr().out

    # The next day a Clear re-runs the create task: it adopts the cluster, and renews its expiry from now.
    again = run_dag(airflow_home, NIGHTLY, "nightly_expiry", logical_date=logical_date)
    assert again["create_cluster"].state == "success"
    renewed = kube.get_object("rayclusters", NAMESPACE, "nightly")["metadata"]["annotations"][EXPIRES_AT_ANNOTATION]
    assert renewed > format_expiry(datetime.now(UTC) + timedelta(minutes=55))
    assert "RayCluster ml/nightly adopted: its expiry is renewed from" in capfd.readouterr().out
    assert run_dag(airflow_home, EXPIRED, "janitor")["delete_expired"].result == []
    assert kube.get_object("rayclusters", NAMESPACE, "nightly") is not None


OPTIONS = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 2, "retry_delay": 0}},
         params={{"image": Param("rayproject/ray:2.60.0-py311-tpu"), "worker_cpu": Param("8"), "team": Param("ml")}}):
    CreateRayClusterOperator(
        task_id="create_cluster", cluster_name="options", accelerator="v6e", topology="2x4",
        cluster_options={{
            "image": "{{{{ params.image }}}}",
            "worker_resources": {worker_resources},
            "head_ray_start_params": {{"num-cpus": "{{{{ params.worker_cpu | int - 8 }}}}"}},
            "labels": {{"team": "{{{{ params.team }}}}"}},
            "env": {{"RUN": "{{{{ run_id }}}}"}},
        }},
    )
'''


def test_params_choose_the_cluster_options(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    """Every cluster option is templated, inside mappings too."""
    from airflow_provider_raytpu.manifests.options import RayClusterOptions
    from airflow_provider_raytpu.manifests.raycluster import SPEC_HASH_ANNOTATION, build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    source = OPTIONS.format(dag_id="options", worker_resources='{"cpu": "{{ params.worker_cpu }}", "memory": "64Gi"}')
    outcome = run_dag(airflow_home, source, "options",
                      conf={"image": "registry.example/ray:2.61.0-py311-tpu", "worker_cpu": "40", "team": "research"})
    assert outcome["create_cluster"].state == "success"
    stored = kube.get_object("rayclusters", NAMESPACE, "options")
    head, (group,) = stored["spec"]["headGroupSpec"], stored["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert (head["template"]["spec"]["containers"][0]["image"] == worker["image"]
            == "registry.example/ray:2.61.0-py311-tpu")
    assert stored["spec"]["rayVersion"] == "2.61.0", "the version is read from the rendered image, not the template"
    assert worker["resources"]["limits"] == {"cpu": "40", "memory": "64Gi", "google.com/tpu": "8"}
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0", **AGENT_PORTS, "num-cpus": "32"}
    assert stored["metadata"]["labels"]["team"] == "research"
    (run_env,) = worker["env"]
    assert run_env["name"] == "RUN" and run_env["value"].startswith("manual__")
    # The operator renders exactly what the builder renders for the same (rendered) options.
    by_hand = build_ray_cluster(
        name="options", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x4"), options=RayClusterOptions(
            image="registry.example/ray:2.61.0-py311-tpu", worker_resources={"cpu": "40", "memory": "64Gi"},
            head_ray_start_params={"num-cpus": "32"}, labels={"team": "research"}, env={"RUN": run_env["value"]}))
    assert (stored["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
            == by_hand["metadata"]["annotations"][SPEC_HASH_ANNOTATION])


def test_a_whole_options_dict_from_params_with_native_rendering(airflow_home: Path, connections: None,
                                                                 kube: FakeKubeApiServer) -> None:
    source = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("native_options", schedule=None, start_date=datetime(2026, 1, 1), render_template_as_native_obj=True,
         params={"cluster_options": Param({"image": "rayproject/ray:2.60.0-py311-tpu"}, type="object")}):
    CreateRayClusterOperator(task_id="create_cluster", cluster_name="native", accelerator="v6e", topology="2x2",
                             cluster_options="{{ params.cluster_options }}")
'''
    chosen = {"image": "rayproject/ray:2.61.0-py311-tpu", "worker_resources": {"cpu": 16, "memory": "48Gi"},
              "service_account_name": "ray-tpu"}
    outcome = run_dag(airflow_home, source, "native_options", conf={"cluster_options": chosen})
    assert outcome["create_cluster"].state == "success"
    spec = kube.get_object("rayclusters", NAMESPACE, "native")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert spec["containers"][0]["image"] == "rayproject/ray:2.61.0-py311-tpu"
    assert spec["containers"][0]["resources"]["requests"] == {"cpu": "16", "memory": "48Gi", "google.com/tpu": "4"}
    assert spec["serviceAccountName"] == "ray-tpu"


def test_an_option_that_renders_to_the_wrong_type_fails_before_any_api_call(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    # Without native rendering a template renders a string, not the dict worker_resources must be.
    source = OPTIONS.format(dag_id="bad_options", worker_resources='"{{ params.worker_cpu }}"')
    outcome = run_dag(airflow_home, source, "bad_options")
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert kube.count("POST") == 0
    assert "worker_resources='8': is not a mapping" in capfd.readouterr().out


DATA_OVER_INPUT = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
from airflow_provider_raytpu.operators.ray_data import RayDataOperator

with DAG("data_over_input", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 2},
         params={"raw": Param("gs://b/raw"), "clean": Param("gs://b/raw/clean")}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2")
    clean = RayDataOperator(task_id="clean", cluster=create.output, input_uri="{{ params.raw }}",
                            output_uri="{{ params.clean }}", transform="pipeline.transforms:normalise")
    create >> clean
'''


def test_a_templated_output_over_its_input_fails_before_any_job_is_submitted(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    outcome = run_dag(airflow_home, DATA_OVER_INPUT, "data_over_input")
    assert outcome["create_cluster"].state == "success"
    assert (outcome["clean"].state, outcome["clean"].try_number) == ("failed", 1), "bad input is not retried"
    assert ("output_uri='gs://b/raw/clean': lies inside the input 'gs://b/raw'. Replacing an output deletes what is "
            "there") in capfd.readouterr().out
    assert kube.count("GET", r"/proxy/") == kube.count("POST", r"/proxy/") == 0, "nothing reached the dashboard"


TRAIN_ON_SPOT = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

with DAG("train_on_spot", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 2}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2")
    JaxTrainerOperator(task_id="train", cluster=create.output, train_loop="pipeline.train:loop",
                       checkpoint_uri="gs://b/ckpt", topology="2x2", capacity="spot")
'''


def test_a_training_task_stating_spot_on_an_on_demand_cluster_fails_before_any_job_is_submitted(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    outcome = run_dag(airflow_home, TRAIN_ON_SPOT, "train_on_spot")
    assert outcome["create_cluster"].state == "success"
    assert (outcome["train"].state, outcome["train"].try_number) == ("failed", 1), "bad input is not retried"
    assert (f"capacity='spot': disagrees with RayCluster {NAMESPACE}/train-on-spot-create-cluster-"
            ) in capfd.readouterr().out
    assert kube.count("GET", r"/proxy/") == kube.count("POST", r"/proxy/") == 0, "nothing reached the dashboard"


def test_an_expired_cluster_running_a_ray_job_is_kept_until_the_job_ends(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice
    from tests.support.jobs_stub import JobsStub

    expired = format_expiry(datetime.now(UTC) - timedelta(minutes=5))
    kube.create_object(build_ray_cluster(name="busy", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                         expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    kube.set_status("rayclusters", NAMESPACE, "busy", {"conditions": [  # a head runs: its jobs are asked for
        {"type": "HeadPodReady", "status": "True", "reason": "HeadPodRunningAndReady",
         "lastTransitionTime": "2026-12-02T00:00:00Z"}]})
    kube.create_object({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "busy-head-svc",
                        "namespace": NAMESPACE}, "spec": {"ports": [{"name": "dashboard", "port": 8265}]}})
    with JobsStub() as jobs:
        kube.register_service_proxy(NAMESPACE, "busy-head-svc", "dashboard", jobs.url_for("busy"))
        jobs.add("busy", "raytpu-train-try1", log="step 1\n")
        assert run_dag(airflow_home, EXPIRED, "janitor")["delete_expired"].result == []
        assert (f"RayCluster {NAMESPACE}/busy expired at {expired} but is not deleted: Ray job(s) raytpu-train-try1 "
                "still running on it") in capfd.readouterr().out
        jobs.finish("busy", "raytpu-train-try1")
        assert run_dag(airflow_home, EXPIRED, "janitor")["delete_expired"].result == [f"{NAMESPACE}/busy"]


def test_a_namespace_that_is_not_a_dns_label_fails_before_any_request(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    source = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("bad_namespace", schedule=None, start_date=datetime(2026, 1, 1), params={"ns": Param("ml/../kube-system")}):
    CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2", namespace="{{ params.ns }}")
'''
    outcome = run_dag(airflow_home, source, "bad_namespace")
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert "namespace='ml/../kube-system': is not a Kubernetes namespace" in capfd.readouterr().out
    assert kube.count(None, r"kube-system") == 0 and kube.count("POST") == 0


def test_dashboard_url_credentials_never_reach_xcom_or_links(
        airflow_home: Path, kube: FakeKubeApiServer, kuberay: KubeRayReactor, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.kube_connection import raytpu_connection

    monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection(NAMESPACE))
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(
        dashboard="url", dashboard_url="https://raytpu:s3cr3t-pw@ray.example.com/{namespace}/{cluster_name}"))
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="creds_in_url"), "creds_in_url")
    created = outcome["create_cluster"]
    assert created.state == "success"
    assert created.result["dashboard_url"] == f"https://ray.example.com/{NAMESPACE}/nightly-train"
    assert "s3cr3t" not in json.dumps([created.links, outcome["wait_ready"].links, created.result])


def test_a_templated_shape_gke_does_not_offer_fails_on_gke_and_warns_on_kubernetes(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Ray's table has v6e 2x8; GKE makes no node pool of it. On kubernetes (TPU nodes of your own) it is used."""
    conf = {"accelerator": "v6e", "topology": "2x8", "slices": "1", "capacity": "on-demand"}
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="own_2x8"), "own_2x8", conf=conf)
    assert outcome["create_cluster"].state == "success"
    assert ("v6e 2x8 is not a slice shape GKE offers (a node pool of it cannot be created, and its pods would stay "
            "Pending). The shapes GKE offers of v6e: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16. On backend "
            "'kubernetes' it is used as given") in capfd.readouterr().out

    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps({"conn_type": "raytpu", "extra": {
        "backend": "gke", "project_id": "p", "location": "us-east5", "cluster": "tpu", "namespace": NAMESPACE,
        "confirm_with_ray": False}}))
    posts = kube.count("POST")
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="gke_2x8"), "gke_2x8", conf=conf)
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert "topology='2x8': is not a slice shape GKE offers of v6e" in capfd.readouterr().out
    assert kube.count("POST") == posts
