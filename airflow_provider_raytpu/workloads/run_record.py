"""What a training run was started with, so a resume under another config is a decision, not an accident.

A run resumes from the newest checkpoint under its run name (a retry, a Clear with
``resume_on_clear``). If the DAG's training config changed in between (another learning rate,
another dataset), resuming would continue one model with two configs. The run's first start
writes ``<checkpoint_uri>/<run_name>/raytpu_run.json``: a digest of the config that decides what is
trained, and one digest per top-level key (only digests: config values may be secrets, and the
record lives beside the checkpoints). A later start compares:

- the same digest: resume;
- another digest, ``on_config_change="fail"`` (the default): :class:`TrainingConfigChangedError`,
  naming the keys that changed, before anything is trained;
- ``"start_fresh"``: a new run from step 0 under ``<run_name>-c<digest>`` (the old checkpoints are
  kept; a retry with the same config resumes that new run);
- ``"resume"``: resume anyway; the record takes the new digest and notes the change.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the operator reads ON_CONFIG_CHANGE when a DAG is parsed: no pyarrow then
    from airflow_provider_raytpu.workloads.storage import Location

RECORD_NAME = "raytpu_run.json"
ON_CONFIG_CHANGE = ("fail", "start_fresh", "resume")


class TrainingConfigChangedError(Exception):
    """A run would resume checkpoints trained with another config."""


def digest(value: Any) -> str:
    """A stable digest of a JSON value (key order does not matter)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def key_digests(config: Mapping[str, Any]) -> dict[str, str]:
    """One digest per key, nested mappings by dotted path (``config.learning_rate``)."""
    digests: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            digests.update({f"{key}.{inner}": d for inner, d in key_digests(value).items()})
        else:
            digests[str(key)] = digest(value)
    return digests


def read_record(run: Location) -> dict[str, Any] | None:
    try:
        with run.filesystem.open_input_stream(run.child(RECORD_NAME).path) as stream:
            record = json.loads(stream.read())
    except (FileNotFoundError, OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("digest"), str) else None


def _record(config: Mapping[str, Any], history: list[Any]) -> bytes:
    return json.dumps({"digest": digest(config), "keys": key_digests(config), "history": history},
                      indent=1).encode()


def changed_keys(recorded: Mapping[str, str], config: Mapping[str, Any]) -> list[str]:
    now = key_digests(config)
    return sorted(key for key in {*recorded, *now} if recorded.get(key) != now.get(key))


def settle_run(root: Location, run_name: str, config: Mapping[str, Any], on_config_change: str = "fail") -> str:
    """The run name to train under: ``run_name``, or a fresh run's when its config changed and the task says so.

    :param root: the checkpoint root (``checkpoint_uri``); the run lives at ``root/run_name``.
    :param run_name: the run the task resumes or starts.
    :param config: what decides what is trained (the loop, its config, the datasets, the batch size).
    :param on_config_change: ``fail``, ``start_fresh`` or ``resume`` (see the module docstring).
    :raises TrainingConfigChangedError: the run was started with another config, and ``fail``.
    """
    from airflow_provider_raytpu.workloads.storage import write_file

    if on_config_change not in ON_CONFIG_CHANGE:
        raise ValueError(f"on_config_change={on_config_change!r} is not one of {ON_CONFIG_CHANGE}")
    run = root.child(run_name)
    record = read_record(run)
    if record is None:
        write_file(run.child(RECORD_NAME), _record(config, []))
        return run_name
    if record["digest"] == digest(config):
        return run_name
    changed = changed_keys(record.get("keys") or {}, config)
    if on_config_change == "start_fresh":
        return settle_run(root, f"{run_name}-c{digest(config)[:8]}", config, "fail")
    if on_config_change == "resume":
        history = [*record.get("history", []), {"resumed_with_changed_keys": changed, "at": time.time(),
                                                "previous_digest": record["digest"]}]
        write_file(run.child(RECORD_NAME), _record(config, history))
        return run_name
    raise TrainingConfigChangedError(
        f"training run {run_name} ({run.uri}) was started with another training config: {', '.join(changed)} "
        "changed. Resuming its checkpoints would train one model under two configs. Set "
        "on_config_change='start_fresh' to train a new run from step 0 (its checkpoints are kept), or "
        "on_config_change='resume' to resume it anyway")
