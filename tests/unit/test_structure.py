"""The package's shape, read from its source: no import circle, small modules, imports that point down."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_provider_raytpu"
ROOT = PACKAGE.name
MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted(PACKAGE.rglob("*.py"))
}
CLOUD_AND_RAY = ("ray", "jax", "orbax", "kubernetes", "kubernetes_asyncio", "google")


def imports(path: Path, *, module_scope_only: bool = False) -> list[str]:
    """Every module ``path`` imports (``from a import b`` gives ``a.b``), anywhere in it or at module scope only.
    An import under ``if TYPE_CHECKING:`` is at module scope."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if not module_scope_only else _module_scope(tree.body)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return found


def _module_scope(body: list[ast.stmt]) -> list[ast.stmt]:
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            found += _module_scope([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
    return found


def package_imports(name: str) -> set[str]:
    """The package's own modules that module ``name`` imports."""
    return {target for target in imports(MODULES[name]) if target in MODULES and target != name}


def test_the_package_has_no_import_circle() -> None:
    graph = {name: package_imports(name) for name in MODULES}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"Import circle: {' -> '.join(exc.args[1])}")


def test_the_circle_check_finds_a_circle() -> None:
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).static_order())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_has_at_most_400_lines(name: str) -> None:
    assert len(MODULES[name].read_text().splitlines()) <= 400, f"{name} is over 400 lines: split it by its jobs"


def _tops(names: list[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith((f"{ROOT}.manifests", f"{ROOT}.status"))
                                  or n in (f"{ROOT}.tpu", f"{ROOT}.gke_tpu", f"{ROOT}.capacity", f"{ROOT}.values")])
def test_a_pure_module_imports_no_airflow_ray_or_cloud_client(name: str) -> None:
    assert not _tops(imports(MODULES[name])) & {"airflow", *CLOUD_AND_RAY}


#: DESIGN.md's layers, top down: a module imports only from the layers below its own (and from its own package).
LAYERS = {"operators": 0, "sensors": 0, "tasks": 1, "triggers": 2, "hooks": 3, "backends": 4, "dashboard": 5,
          "manifests": 6, "status": 7}


def _layer(name: str) -> int | None:
    """The layer of a module in one of :data:`LAYERS`' packages, else ``None``."""
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 2 else None


def upward_imports(name: str) -> list[str]:
    """The package's modules that ``name`` imports from its own layer (another package) or a layer above."""
    own, package = _layer(name), name.split(".")[1]
    layers = {target: _layer(target) for target in package_imports(name) if target.split(".")[1] != package}
    return sorted(target for target, layer in layers.items() if None not in (own, layer) and layer <= own)


@pytest.mark.parametrize("name", [n for n in MODULES if _layer(n) is not None])
def test_a_module_imports_only_from_the_layers_below_its_own(name: str) -> None:
    assert upward_imports(name) == []


def test_the_layer_check_sees_a_task_helper_import_an_operator(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "helper.py"
    source.write_text("from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator\n"
                      "from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger\n")
    monkeypatch.setitem(MODULES, f"{ROOT}.tasks.helper", source)
    assert upward_imports(f"{ROOT}.tasks.helper") == [f"{ROOT}.operators.raycluster"]


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith(f"{ROOT}.workloads")])
def test_a_workload_never_imports_airflow(name: str) -> None:
    assert "airflow" not in _tops(imports(MODULES[name]))


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith(
    tuple(f"{ROOT}.{layer}" for layer in ("operators", "sensors", "triggers", "hooks")))])
def test_a_task_module_imports_no_ray_or_cloud_client_at_module_scope(name: str) -> None:
    assert not _tops(imports(MODULES[name], module_scope_only=True)) & set(CLOUD_AND_RAY)


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith(f"{ROOT}.dashboard")
                                  or n in (f"{ROOT}.connection", f"{ROOT}.loop_shared", f"{ROOT}.progress")])
def test_the_dashboard_clients_and_shared_plumbing_import_no_airflow(name: str) -> None:
    assert "airflow" not in _tops(imports(MODULES[name]))


@pytest.mark.parametrize("name", [n for n in MODULES
                                  if not n.startswith((f"{ROOT}.workloads", f"{ROOT}.backends.local"))])
def test_the_airflow_side_never_imports_ray(name: str) -> None:
    """Ray runs on the cluster (and in the local backend's processes); Airflow speaks its REST APIs."""
    assert not _tops(imports(MODULES[name])) & {"ray", "jax", "orbax"}


DELETES = ("delete_cluster", "delete_service", "delete", "remove_locked")
#: Deletes that act on no checked object by design: a RayService's own local cluster, removed with the service.
UNCHECKED_DELETES = {("airflow_provider_raytpu.backends.local.serve", "delete_cluster")}


def unchecked_deletes(name: str) -> list[str]:
    """The calls in module ``name`` that delete a RayCluster or RayService without a precondition."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DELETES):
            continue
        receiver = ast.unparse(node.func.value)
        if node.func.attr == "delete" and "store" not in receiver and "objects" not in receiver:
            continue  # another kind of delete (a file, a dict entry)
        given = len(node.args) >= 3 or any(keyword.arg == "precondition" for keyword in node.keywords)
        if not given and (name, node.func.attr) not in UNCHECKED_DELETES:
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_every_delete_in_the_package_names_the_object_whose_owner_was_checked() -> None:
    assert [call for name in MODULES for call in unchecked_deletes(name)] == []


def test_the_delete_check_finds_a_delete_by_name_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "sweep.py"
    source.write_text("def sweep(backend):\n    backend.delete_cluster('train', 'ml')\n"
                      "    backend.delete_cluster('train', 'ml', precondition=None)\n")
    monkeypatch.setitem(MODULES, "sweep", source)
    assert unchecked_deletes("sweep") == ["sweep:2 backend.delete_cluster('train', 'ml')"]



def _private_airflow_name(imported: str) -> bool:
    parts = imported.split(".")
    return parts[0] == "airflow" and any(part.startswith("_") for part in parts)


@pytest.mark.parametrize("name", [n for n in MODULES if n != f"{ROOT}.compat"])
def test_a_private_airflow_name_is_imported_only_in_the_compat_module(name: str) -> None:
    """Airflow's private names (``_internal``, ``_shared``, ``_Name``) move without notice; compat.py imports
    them, and tests/unit/test_compat.py fails when an upgrade moves one."""
    assert [target for target in imports(MODULES[name]) if _private_airflow_name(target)] == []


def _private_ray_name(imported: str) -> bool:
    parts = imported.split(".")
    return parts[0] == "ray" and any(part.startswith("_") for part in parts)


@pytest.mark.parametrize("name", [n for n in MODULES if n != f"{ROOT}.workloads.ray_compat"])
def test_a_private_ray_name_is_imported_only_in_the_ray_compat_module(name: str) -> None:
    """Ray's private names (``_internal``, ``_private``, ``_raylet``) move without notice; workloads/ray_compat.py
    looks them up, and tests/unit/test_compat.py fails when a Ray upgrade moves one."""
    assert [target for target in imports(MODULES[name]) if _private_ray_name(target)] == []


def test_the_private_name_check_sees_one() -> None:
    assert _private_ray_name("ray.data._internal.batcher.Batcher") and _private_ray_name("ray._raylet")
    assert not _private_ray_name("ray.data.block.BlockAccessor")
    assert _private_airflow_name("airflow.sdk.definitions._internal.mixins.ResolveMixin")
    assert _private_airflow_name("airflow.providers.cncf.kubernetes.kube_client._TimeoutAsyncK8sApiClient")
    assert not _private_airflow_name("airflow.sdk.BaseHook") and not _private_airflow_name("ray.data._internal")
