"""The job result line: printed by workloads, parsed by the operator without Ray or JAX."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from airflow_provider_raytpu.workloads.result import RESULT_PREFIX, last_result, report_result


def test_report_prints_one_prefixed_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    report_result({"rows": np.int64(3), "loss": np.float32(0.5), "nan": float("nan"), "shape": np.arange(2)})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(RESULT_PREFIX)
    assert json.loads(out[len(RESULT_PREFIX):]) == {"rows": 3, "loss": 0.5, "nan": None, "shape": [0, 1]}


def test_report_rejects_a_non_dict() -> None:
    with pytest.raises(TypeError):
        report_result([1, 2])  # type: ignore[arg-type]


def test_last_result_wins(capsys: pytest.CaptureFixture[str]) -> None:
    report_result({"attempt": 1})
    report_result({"attempt": 2})
    logs = "starting\n" + capsys.readouterr().out + "shutting down\n"
    assert last_result(logs) == {"attempt": 2}


def test_last_result_skips_malformed_and_foreign_lines() -> None:
    logs = "\n".join(
        [
            'RAYTPU_RESULT {"ok": 1}',
            "RAYTPU_RESULT [1, 2]",  # not an object
            'echo "RAYTPU_RESULT {\\"fake\\": 1}"',  # mentions the marker mid-line
            'RAYTPU_RESULT {"cut": ',  # cut off when the job was killed
        ]
    )
    assert last_result(logs) == {"ok": 1}


def test_last_result_reads_a_line_behind_a_ray_log_prefix() -> None:
    logs = '(RayTrainWorker pid=123, ip=10.0.0.1) RAYTPU_RESULT {"steps": 40}\n'
    assert last_result(logs) == {"steps": 40}


def test_no_result() -> None:
    assert last_result("") is None
    assert last_result("just logs\nRAYTPU_RESULTS {}\n") is None


def test_result_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, airflow_provider_raytpu.workloads.result\n"
        "print(sorted(m for m in ('ray', 'jax', 'numpy', 'airflow', 'orbax', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
