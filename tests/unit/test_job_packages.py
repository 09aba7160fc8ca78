"""A job's local packages get the name and the content Ray's own client gives them.

Ray (installed in the test environment, not needed by the provider) is the reference: its
``get_uri_for_directory`` / ``get_uri_for_file`` / ``get_uri_for_package`` name a package, its
``create_package`` zips it; ours must agree byte for byte on the names and entry for entry on the zips,
or the cluster would hold two copies of every package, or unpack a different tree.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from airflow_provider_raytpu.dashboard import job_packages
from airflow_provider_raytpu.dashboard.job_packages import hash_walk, upload_local_packages, zip_walk

ray_packaging = pytest.importorskip("ray._private.runtime_env.packaging")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A package with what makes Ray's walk differ from a plain one: ignore files at two levels, an
    empty directory, a cache, a virtualenv, a file ignored only by name below a subdirectory."""
    root = tmp_path / "pipeline"
    files = {
        "__init__.py": "",
        "steps.py": "def run():\n    return 1\n",
        ".gitignore": "*.log\nbuild/\n",
        "run.log": "ignored by .gitignore",
        "build/out.bin": "ignored dir",
        "data/.rayignore": "secret.txt\n",
        "data/secret.txt": "ignored by .rayignore below",
        "data/rows.jsonl": '{"x": 1}\n',
        "data/deep/secret.txt": "ignored too: the pattern has no slash",
        "__pycache__/steps.cpython-311.pyc": "bytecode",
        ".venv/bin/python": "not shipped in a working_dir",
        "notes/big.csv": "excluded by the runtime_env",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "empty").mkdir()
    return root


def zip_entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def ray_zip(path: Path, tmp_path: Path, excludes: list[str], in_parent_dir: bool) -> bytes:
    target = tmp_path / f"ray-{in_parent_dir}.zip"  # create_package keeps a zip that exists
    ray_packaging.create_package(str(path), target, include_gitignore=True, include_parent_dir=in_parent_dir,
                                 excludes=excludes)
    return target.read_bytes()


@pytest.mark.parametrize("excludes", [[], ["notes/"], ["*.csv", "/data/rows.jsonl"], [".venv", "__pycache__"]])
def test_a_directory_has_rays_name_and_rays_zip(tree: Path, tmp_path: Path, excludes: list[str]) -> None:
    ours = "gcs://" + job_packages.PACKAGE_PREFIX + hash_walk(tree, excludes, True).hex() + ".zip"
    assert ours == ray_packaging.get_uri_for_directory(str(tree), include_gitignore=True, excludes=excludes)
    for in_parent_dir in (True, False):
        entries = zip_entries(zip_walk(tree, excludes, True, in_parent_dir))
        assert entries == zip_entries(ray_zip(tree, tmp_path, excludes, in_parent_dir))
    top = zip_entries(zip_walk(tree, excludes, True, in_parent_dir=False))
    assert "steps.py" in top and "empty/" in top and "run.log" not in top and "data/secret.txt" not in top
    assert "data/deep/secret.txt" not in top
    assert ("notes/big.csv" in top) == (excludes in ([], [".venv", "__pycache__"]))


class Dashboard:
    """The two package endpoints of a Ray dashboard, held in a dict (the Jobs API's ``request`` signature)."""

    def __init__(self) -> None:
        self.packages: dict[str, bytes] = {}
        self.puts = 0

    def request(self, method: str, path: str, *, data: bytes | None = None, timeout: float = 60) -> object:
        from airflow_provider_raytpu.dashboard.transport import HttpAnswer

        name = path.removeprefix("/api/packages/gcs/")
        if method == "PUT":
            self.puts += 1
            self.packages[name] = data or b""
            return HttpAnswer(200, b"")
        return HttpAnswer(200 if name in self.packages else 404, b"")


def test_a_runtime_env_ships_its_local_paths_once_each_under_rays_uris(tree: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "helpers.py"
    module.write_text("HELLO = 'hi'\n")
    wheel = tmp_path / "tool-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK wheel bytes")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("emoji==2.14\n\n  pyjokes\n")
    monkeypatch.delenv("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", raising=False)
    dashboard = Dashboard()
    env = {"working_dir": str(tree), "py_modules": [str(tree), str(module), str(wheel), "gs://bucket/pkg.zip"],
           "excludes": ["notes/"], "pip": str(requirements), "env_vars": {"A": "1"}}

    shipped = upload_local_packages(env, dashboard)  # type: ignore[arg-type]

    defaults = [".git", ".venv", "venv", "__pycache__", "notes/"]
    assert shipped["working_dir"] == ray_packaging.get_uri_for_directory(str(tree), True, excludes=defaults)
    assert shipped["py_modules"] == [ray_packaging.get_uri_for_directory(str(tree), True, excludes=["notes/"]),
                                     ray_packaging.get_uri_for_file(str(module)),
                                     "gcs://tool-1.0-py3-none-any.whl", "gs://bucket/pkg.zip"]
    assert shipped["pip"] == ["emoji==2.14", "pyjokes"] and shipped["env_vars"] == {"A": "1"}
    assert env["working_dir"] == str(tree), "the task's own runtime_env is not changed"
    working = zip_entries(dashboard.packages[shipped["working_dir"].removeprefix("gcs://")])
    assert "steps.py" in working and not any(name.startswith((".venv/", "__pycache__/")) for name in working)
    assert zip_entries(dashboard.packages[shipped["py_modules"][1].removeprefix("gcs://")]) == {
        "helpers.py": b"HELLO = 'hi'\n"}
    assert dashboard.packages["tool-1.0-py3-none-any.whl"] == b"PK wheel bytes"

    puts = dashboard.puts
    assert upload_local_packages(env, dashboard) == shipped  # type: ignore[arg-type]
    assert dashboard.puts == puts, "a package the cluster holds is not uploaded again"


def test_a_path_ray_cannot_ship_names_the_field_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"runtime_env py_modules='.*/missing': not a directory, a \.py file or a "
                                         r"\.whl file on this machine; give a local path there, or the URI"):
        upload_local_packages({"py_modules": [str(tmp_path / "missing")]}, Dashboard())  # type: ignore[arg-type]
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"runtime_env working_dir='.*/notes.txt': not a directory or an archive"):
        upload_local_packages({"working_dir": str(tmp_path / "notes.txt")}, Dashboard())  # type: ignore[arg-type]
