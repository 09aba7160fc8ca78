"""The Ray Data preprocessing job on the emulated slice: tasks, an actor pool on TPU hosts, gs:// and replacement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from airflow_provider_raytpu.workloads import outputs, storage
from airflow_provider_raytpu.workloads.preprocess import PreprocessSpec, parse_args, run_preprocess
from airflow_provider_raytpu.workloads.result import EXIT_BAD_INPUT, last_result
from example_dags.pipeline.data import generate_rows, write_dataset
from example_dags.pipeline.transforms import Embedder, normalise
from tests.ray.workloads.ray_slice import REPO, EmulatedSlice, driver_env
from tests.support.gcs import GcsStorage

pytestmark = pytest.mark.ray
ROWS = 600


def read_output(uri: str) -> dict[str, list]:
    """Every row under ``uri``, read with pyarrow straight from storage, sorted by id."""
    location = storage.resolve(uri)
    files = [f for f in storage.list_files(uri) if f.endswith(".parquet")]
    table = pq.ParquetDataset(files, filesystem=location.filesystem).read().sort_by("id")
    return table.to_pydict()


@pytest.fixture(scope="module")
def raw_jsonl(fake_gcs: GcsStorage) -> str:
    return write_dataset(fake_gcs.uri("raw", "rows.jsonl"), ROWS, seed=7, fmt="jsonl")


def test_cli_arguments() -> None:
    spec = parse_args(
        ["--input", "gs://b/in", "--output", "gs://b/out", "--transform", "m:f", "--concurrency", "2",
         "--num-tpus-per-actor", "4", "--resources", '{"CPU": 2, "slice-a": 1}', "--transform-kwargs", '{"dim": 8}']
    )
    assert spec == PreprocessSpec(
        "gs://b/in", "gs://b/out", "m:f", concurrency=2, num_tpus_per_actor=4.0,
        resources={"CPU": 2, "slice-a": 1}, transform_kwargs={"dim": 8},
    )


def test_function_transform_runs_as_tasks(ray_client: EmulatedSlice, raw_jsonl: str, tmp_path: Path) -> None:
    output = str(tmp_path / "clean")
    result = run_preprocess(PreprocessSpec(raw_jsonl, output, "example_dags.pipeline.transforms:normalise",
                                           batch_size=100))
    assert result["rows_in"] == result["rows_out"] == ROWS
    assert result["output_uri"] == output and result["rows_per_second"] > 0
    rows = read_output(output)
    # Exactly what the transform gives when applied to the raw rows here, in one batch.
    raw = generate_rows(ROWS, seed=7)
    expected = normalise({k: np.asarray([r[k] for r in raw], dtype=object if k in ("text", "x") else None)
                          for k in raw[0]})
    assert rows["id"] == list(range(ROWS))
    assert rows["text"] == list(expected["text"])
    np.testing.assert_allclose(np.asarray(rows["features"]), expected["features"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rows["tokens"]), expected["tokens"])


def test_callable_class_runs_as_an_actor_pool_on_tpu_hosts(ray_client: EmulatedSlice, raw_jsonl: str,
                                                           tmp_path: Path) -> None:
    spec = PreprocessSpec(
        raw_jsonl,
        str(tmp_path / "where"),
        "tests.ray.workloads.transforms_for_tests:WhereAmI",
        batch_size=50,
        concurrency=2,
        num_tpus_per_actor=4,  # a whole host's chips: one actor per TPU host
        transform_kwargs={"tag": "from-kwargs"},
    )
    result = run_preprocess(spec)
    assert result["rows_out"] == ROWS
    rows = read_output(spec.output_uri)
    host_nodes = {node.node_id for node in ray_client.hosts.values()}
    assert set(rows["node_id"]) <= host_nodes  # only TPU hosts have "TPU" resources
    assert set(rows["tpu_worker_id"]) <= {"0", "1"}
    # Stateful: each actor built its model once and served many batches (12 batches, <= 2 actors).
    assert 1 <= len(set(rows["instance"])) <= 2
    assert set(rows["tag"]) == {"from-kwargs"}


NOT_COUNTED = "counting the input again"


@pytest.mark.parametrize(("transform", "placement"), [
    ("even_ids", {}),  # counting step, transform and write in one task: the write returns the count
    ("even_ids", {"num_tpus_per_actor": 4}),  # the same, on TPU hosts
    ("even_ids", {"num_tpus_per_actor": 4, "concurrency": 2}),  # capped tasks: the count goes to the tally
    ("EvenIds", {"num_tpus_per_actor": 4, "concurrency": 2}),  # an actor pool, one actor per TPU host: the tally
])
def test_rows_in_and_out_are_counted_in_the_pass_that_writes(ray_client: EmulatedSlice, raw_jsonl: str,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             transform: str, placement: dict) -> None:
    """A transform that drops half its rows: rows read and rows written both come from the one pass."""
    spec = PreprocessSpec(raw_jsonl, str(tmp_path / "even"), f"tests.ray.workloads.transforms_for_tests:{transform}",
                          batch_size=64, **placement)
    result = run_preprocess(spec)
    assert (result["rows_in"], result["rows_out"]) == (ROWS, ROWS // 2)
    assert NOT_COUNTED not in capsys.readouterr().err
    assert read_output(spec.output_uri)["id"] == list(range(0, ROWS, 2))


@pytest.mark.parametrize("placement", [{}, {"concurrency": 1}], ids=["write-returns", "tally"])
def test_a_task_run_again_after_its_worker_died_is_counted_once(ray_client: EmulatedSlice, raw_jsonl: str,
                                                                tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                placement: dict) -> None:
    """The worker dies after the counting step counted the block it read: the task's second run replaces that
    count instead of adding to it."""
    marker = tmp_path / "crashed"
    spec = PreprocessSpec(raw_jsonl, str(tmp_path / "out"), "tests.ray.workloads.transforms_for_tests:crash_once",
                          batch_size=100, transform_kwargs={"marker": str(marker)}, **placement)
    result = run_preprocess(spec)
    assert marker.exists()  # it did crash once
    assert (result["rows_in"], result["rows_out"]) == (ROWS, ROWS)
    assert NOT_COUNTED not in capsys.readouterr().err
    assert read_output(spec.output_uri)["id"] == list(range(ROWS))


def test_gcs_job_replaces_its_output_on_rerun(ray_slice: EmulatedSlice, fake_gcs: GcsStorage, raw_jsonl: str) -> None:
    output = fake_gcs.uri("embedded")
    prefix = output.split("/", 3)[3]
    command = [
        sys.executable, "-m", "airflow_provider_raytpu.workloads.preprocess",
        "--input", raw_jsonl, "--output", output, "--transform", "example_dags.pipeline.transforms:Embedder",
        "--concurrency", "1", "--batch-size", "200", "--transform-kwargs", '{"dim": 8}',
    ]
    env = driver_env(ray_slice)

    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    result = last_result(first.stdout)
    assert result is not None and result["rows_in"] == result["rows_out"] == ROWS
    assert result["output_uri"] == output
    first_files = fake_gcs.objects(prefix + "/")
    first_rows = read_output(output)

    # Leftovers of a crashed earlier try of this run: its staging prefix (with its record, written first).
    location = storage.resolve(output)
    crashed = location.sibling(location.name + outputs.TEMP_SUFFIX).child(
        outputs.staging_name("", {"run_id": "r1", "try_number": 1}))
    outputs.write_record(crashed, outputs.OutputRecord(""))
    storage.write_file(crashed.child("part-0-from-a-crashed-attempt.parquet"), b"junk")
    command += ["--attempt", '{"run_id": "r1", "try_number": 2}']
    # A file this task did not write, in its output prefix: refused, nothing deleted, no retry.
    foreign = location.child("stale-duplicate.parquet")
    pq.write_table(pq.read_table(next(f for f in storage.list_files(output) if f.endswith(".parquet")),
                                 filesystem=location.filesystem), foreign.path, filesystem=location.filesystem)
    refused = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-3000:]
    assert "holds 1 file(s) this task did not write (stale-duplicate.parquet); nothing was deleted" in refused.stderr
    assert len(read_output(output)["id"]) > ROWS  # the first output and the foreign file, untouched
    location.filesystem.delete_file(foreign.path)

    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert last_result(second.stdout)["rows_out"] == ROWS
    rows = read_output(output)
    assert rows["id"] == list(range(ROWS))  # each row exactly once
    bookkeeping = {f"{prefix}/{name}" for name in outputs.BOOKKEEPING}
    assert not set(fake_gcs.objects(prefix + "/")) & set(first_files) - bookkeeping, "each data file: second run"
    staged = [name for name in fake_gcs.objects(prefix + ".raytpu-tmp") if not name.endswith("/")]  # no markers
    assert not staged, "the crashed try's staging and this try's own: none left"
    # The embedding model is deterministic: same seed, same vectors, in any actor, on any run.
    np.testing.assert_array_equal(np.asarray(rows["embedding"]), np.asarray(first_rows["embedding"]))
    local = Embedder(dim=8)({"text": np.asarray(rows["text"][:5], dtype=object)})
    np.testing.assert_allclose(local["embedding"], np.asarray(rows["embedding"][:5]), atol=1e-6)


def test_input_only_the_author_can_fix_exits_with_code_2(ray_client: EmulatedSlice, raw_jsonl: str,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit code 2 makes the Airflow task fail without retries: no retry fixes a typo or a missing column."""
    from airflow_provider_raytpu.workloads.preprocess import main
    from airflow_provider_raytpu.workloads.result import EXIT_BAD_INPUT

    common = ["--output", str(tmp_path / "out"), "--batch-size", "50"]
    assert main(["--input", raw_jsonl, *common, "--transform", "example_dags.pipeline.transfroms:normalise"]) == (
        EXIT_BAD_INPUT)
    assert "transfroms" in capsys.readouterr().err
    only_ids = tmp_path / "ids.jsonl"
    only_ids.write_text("".join(f'{{"id": {i}}}\n' for i in range(10)))
    assert main(["--input", str(only_ids), *common, "--transform", "example_dags.pipeline.transforms:normalise"]) == (
        EXIT_BAD_INPUT)
    assert "needs column" in capsys.readouterr().err
    # An output over its input: refused before anything is read or written; the input is intact.
    assert main(["--input", str(only_ids), "--output", f"{tmp_path}/", "--transform",
                 "example_dags.pipeline.transforms:normalise"]) == EXIT_BAD_INPUT
    assert f"the output '{tmp_path}/' contains the input '{only_ids}'" in capsys.readouterr().err
    assert only_ids.read_text().count("\n") == 10
