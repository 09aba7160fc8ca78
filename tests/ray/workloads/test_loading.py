"""Finding user code by import path."""

from __future__ import annotations

import pytest

from airflow_provider_raytpu.workloads.loading import check_importable, load_object, split_import_path


def test_split() -> None:
    assert split_import_path("pipeline.transforms:normalise") == ("pipeline.transforms", "normalise")
    for bad in ("pipeline.transforms", ":f", "m:", "a b:c", "", "not.a.module:fn", "mod:1fn", "m:f.", "m..n:f"):
        with pytest.raises(ValueError, match="is not an import path"):
            split_import_path(bad)


def test_load_function_class_and_nested_attribute() -> None:
    assert load_object("os.path:join").__name__ == "join"
    assert load_object("collections:OrderedDict.fromkeys") is not None


def test_clear_errors() -> None:
    with pytest.raises(ImportError, match="Ship the package with the job"):
        load_object("no_such_pkg_xyz.mod:f")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_object("os:nope")
    with pytest.raises(ImportError, match="cannot find module"):
        check_importable("no_such_pkg_xyz.mod:f")
    check_importable("example_dags.pipeline.train_loop:train_loop_per_worker")  # found, not imported
