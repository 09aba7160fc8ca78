"""Find user code by import path: ``"package.module:name"``."""

from __future__ import annotations

import importlib
import importlib.util
import keyword
from typing import Any


def split_import_path(path: str) -> tuple[str, str]:
    """Split ``"package.module:name"`` into its module and attribute, checking the form.

    :param path: the import path, e.g. ``"pipeline.transforms:normalise"``.
    """
    module, sep, name = (path or "").partition(":")
    parts = [*module.split("."), *name.split(".")]
    if not sep or not all(part.isidentifier() and not keyword.iskeyword(part) for part in parts):
        raise ValueError(f"{path!r} is not an import path: write 'package.module:name' (Python names, dotted)")
    return module, name


def load_object(path: str) -> Any:
    """Import ``"package.module:name"`` and return the named object (dots in ``name`` walk attributes).

    :param path: the import path.
    """
    module_name, name = split_import_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"cannot import {module_name!r} for {path!r}: {error}. Ship the package with the job "
            "(runtime_env py_modules / working_dir) or install it in the cluster image"
        ) from error
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{module_name!r} has no attribute {name!r} (from {path!r})") from None
    return obj


def check_importable(path: str) -> None:
    """Fail early if the module of ``path`` cannot be found, without importing it.

    Parent packages are imported to locate it (as Python does), the module itself is not.

    :param path: the import path.
    """
    module_name, _ = split_import_path(path)
    try:
        spec = importlib.util.find_spec(module_name)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise ImportError(
            f"cannot find module {module_name!r} for {path!r}. Ship the package with the job "
            "(runtime_env py_modules / working_dir) or install it in the cluster image"
        )
