"""Ray Data preprocessing job: read parquet/JSONL -> the user's batch transform -> parquet.

Run as a Ray job driver::

    python -m airflow_provider_raytpu.workloads.preprocess \\
        --input gs://bucket/raw.jsonl --output gs://bucket/clean \\
        --transform pipeline.transforms:normalise

The transform is ``"package.module:name"``:

- a plain function ``fn(batch) -> batch`` runs as stateless Ray tasks;
- a callable class (``__init__`` loads a model once, ``__call__(batch) -> batch``) runs
  as a pool of ``--concurrency`` actors, each with its own resources, e.g. one TPU host
  per actor with ``--num-tpus-per-actor 4``.

The input is read once: the rows read and written are counted in the pass that transforms and
writes (:mod:`~airflow_provider_raytpu.workloads.row_tally`).

Re-running for the same output URI replaces the output its task (``--owner``) wrote there,
and refuses a prefix holding anything else (see
:func:`~airflow_provider_raytpu.workloads.outputs.replace_output`); an output that overlaps
the input (the same prefix, or one inside the other) is refused before anything is read. The job
prints ``RAYTPU_RESULT {"rows_in", "rows_out", "output_uri", "output_version", "input_version", "seconds",
"rows_per_second"}`` (``input_version``: the version read when the input is an output this provider wrote).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_raytpu.workloads.datasets import FORMATS, read_committed, write_parquet_replacing
from airflow_provider_raytpu.workloads.lease import LeaseLostError, OutputLeaseBusyError
from airflow_provider_raytpu.workloads.loading import load_object
from airflow_provider_raytpu.workloads.outputs import OutputNotOwnedError
from airflow_provider_raytpu.workloads.result import EXIT_BAD_INPUT, report_result
from airflow_provider_raytpu.workloads.session import connect
from airflow_provider_raytpu.workloads.uris import APART_FIX, OutputOverlapError, output_overlap


@dataclass(frozen=True)
class PreprocessSpec:
    """What one preprocessing job does.

    :param input_uri: parquet or JSONL file / prefix to read.
    :param output_uri: parquet prefix to (re)place.
    :param transform: ``"package.module:name"`` of a batch function or callable class.
    :param input_format: ``"parquet"`` or ``"jsonl"``; guessed from ``input_uri`` if ``None``.
    :param batch_size: rows per batch handed to the transform (Ray's default if ``None``).
    :param concurrency: actors in the pool for a class (default 1); maximum parallel
        tasks for a function (unlimited if ``None``).
    :param num_tpus_per_actor: TPU chips each actor / task reserves (``resources={"TPU": n}``).
    :param resources: further Ray resources per actor / task; ``CPU`` and ``GPU`` keys
        become ``num_cpus`` / ``num_gpus``.
    :param transform_kwargs: keyword arguments for the class constructor, or for each
        call of a function.
    :param batch_format: the batch type the transform receives: ``numpy`` (dict of
        arrays), ``pandas`` or ``pyarrow``.
    :param owner: the task writing the output (only its own earlier output is replaced).
    :param attempt: the run and try writing it (``{"run_id", "try_number"}``): its staging prefix, and
        what writers waiting for the output are shown.
    """

    input_uri: str
    output_uri: str
    transform: str
    input_format: str | None = None
    batch_size: int | None = None
    concurrency: int | None = None
    num_tpus_per_actor: float | None = None
    resources: dict[str, float] = field(default_factory=dict)
    transform_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_format: str = "numpy"
    owner: str = ""
    attempt: dict[str, Any] = field(default_factory=dict)


def check_output_apart(input_uri: str, output_uri: str) -> None:
    """Refuse an output that overlaps the input: replacing it would delete the input.

    :raises OutputOverlapError: naming both URIs and how they overlap.
    """
    if problem := output_overlap(input_uri, output_uri):
        raise OutputOverlapError(f"the output {output_uri!r} {problem}. {APART_FIX}")


def _remote_args(spec: PreprocessSpec) -> dict[str, Any]:
    resources = dict(spec.resources)
    args: dict[str, Any] = {}
    if "CPU" in resources:
        args["num_cpus"] = resources.pop("CPU")
    if "GPU" in resources:
        args["num_gpus"] = resources.pop("GPU")
    if spec.num_tpus_per_actor:
        resources["TPU"] = spec.num_tpus_per_actor
    if resources:
        args["resources"] = resources
    return args


def transform_dataset(dataset: Any, spec: PreprocessSpec, tally: Any = None) -> Any:
    """Apply the spec's transform to ``dataset`` with ``map_batches`` (tasks or an actor pool), after a step that
    counts the rows it reads (:func:`~airflow_provider_raytpu.workloads.row_tally.counted`).

    :param dataset: a ``ray.data.Dataset``.
    :param spec: the job description.
    :param tally: the :class:`~airflow_provider_raytpu.workloads.row_tally.RowTally` the counting step reports to
        (``None``: the write returns the count, :func:`counted_in_one_task`).
    """
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    from airflow_provider_raytpu.workloads.row_tally import counted

    transform = load_object(spec.transform)
    options: dict[str, Any] = {"batch_format": spec.batch_format, **_remote_args(spec)}
    if spec.batch_size is not None:
        options["batch_size"] = spec.batch_size
    if inspect.isclass(transform):
        if "__call__" not in dir(transform):  # its instances are what Ray calls
            raise TypeError(f"{spec.transform} is a class without __call__(batch)")
        options["compute"] = ActorPoolStrategy(size=spec.concurrency or 1)
        options["fn_constructor_kwargs"] = spec.transform_kwargs
        counting: dict[str, Any] = {}  # a task step fuses into an actor at any concurrency
    elif callable(transform):
        counting = {"compute": TaskPoolStrategy(size=spec.concurrency)}  # tasks fuse at the same concurrency only
        options.update(counting, fn_kwargs=spec.transform_kwargs)
    else:
        raise TypeError(f"{spec.transform} is neither a function nor a callable class")
    return counted(dataset, tally, **counting, **_remote_args(spec)).map_batches(transform, **options)


def counted_in_one_task(spec: PreprocessSpec, transform: Any) -> bool:
    """Whether the counting step, the transform and the write run as one task: for a function without a
    concurrency cap. (Ray 2.60 fuses a capped function with its write, then gives the fused operator the default
    compute, ``operator_fusion._get_fused_map_operator``: the counting step would lift the cap. An actor pool is
    never fused with the write.) Otherwise the counting step reports to a ``RowTally``."""
    return not inspect.isclass(transform) and spec.concurrency is None


def run_preprocess(spec: PreprocessSpec) -> dict[str, Any]:
    """Run the job in this process (connecting to Ray if needed) and return its result.

    :param spec: the job description.
    """
    check_output_apart(spec.input_uri, spec.output_uri)
    started = time.monotonic()
    connected = connect()
    try:
        import ray

        from airflow_provider_raytpu.workloads.row_tally import rows_read, start_tally

        source, input_version = read_committed(spec.input_uri, spec.input_format)
        in_one_task = counted_in_one_task(spec, load_object(spec.transform))
        tally = None if in_one_task else start_tally()
        try:
            write = {"ray_remote_args": _remote_args(spec)} if in_one_task else {}  # the same: Ray fuses them
            target, version, written = write_parquet_replacing(transform_dataset(source, spec, tally),
                                                               spec.output_uri, spec.owner, spec.attempt, **write)
            rows_in = rows_read(written, tally)
        finally:
            if tally is not None:
                ray.kill(tally)
        if rows_in is None:
            print("Not every write task counted the rows it read; counting the input again", file=sys.stderr)
            rows_in = source.count()
    finally:
        if connected:
            ray.shutdown()
    seconds = time.monotonic() - started
    return {
        "rows_in": rows_in,
        "rows_out": int(written.num_rows),
        "output_uri": target.uri,
        "output_version": version,
        "input_version": input_version,
        "seconds": round(seconds, 3),
        "rows_per_second": round(rows_in / seconds, 3) if seconds > 0 else None,
    }


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> PreprocessSpec:
    """Parse the command line into a :class:`PreprocessSpec`.

    :param argv: arguments without the program name; ``sys.argv[1:]`` if ``None``.
    """
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_raytpu.workloads.preprocess")
    parser.add_argument("--input", required=True, help="parquet/JSONL file or prefix (gs:// or local)")
    parser.add_argument("--output", required=True, help="output parquet prefix; replaced on every run")
    parser.add_argument("--transform", required=True, help="package.module:function_or_class")
    parser.add_argument("--format", choices=FORMATS, default=None, help="input format (guessed if omitted)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--num-tpus-per-actor", type=float, default=None)
    parser.add_argument("--resources", type=_json_object, default={}, help='JSON, e.g. {"TPU": 4}')
    parser.add_argument("--transform-kwargs", type=_json_object, default={})
    parser.add_argument("--batch-format", choices=("numpy", "pandas", "pyarrow"), default="numpy")
    parser.add_argument("--owner", default="", help="the task writing the output (its earlier output is replaced)")
    parser.add_argument("--attempt", type=_json_object, default={},
                        help='the run and try writing, e.g. {"run_id": "manual__1", "try_number": 1}')
    args = parser.parse_args(argv)
    return PreprocessSpec(
        input_uri=args.input,
        output_uri=args.output,
        transform=args.transform,
        input_format=args.format,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        num_tpus_per_actor=args.num_tpus_per_actor,
        resources=args.resources,
        transform_kwargs=args.transform_kwargs,
        batch_format=args.batch_format,
        owner=args.owner,
        attempt=args.attempt,
    )


_REMOTE_KEY_ERROR = re.compile(r"^\s*KeyError: (.+)$", re.MULTILINE)


def _missing_column(error: BaseException) -> str | None:
    """The column a transform asked for and the batch did not have (its ``KeyError``), or None.

    A transform's exception reaches the driver pickled inside Ray's ``RayTaskError``, and pickling
    drops ``__cause__``: the ``KeyError`` then survives only in the task's traceback, which the
    error's text renders (``RayTaskError.__str__`` in ray/exceptions.py).
    """
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, KeyError):
            return str(cause)
        cause = cause.__cause__ or getattr(cause, "cause", None)
    remote = _REMOTE_KEY_ERROR.search(str(error))
    return remote.group(1) if remote else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, print the result line. Returns the process exit code:
    :data:`~airflow_provider_raytpu.workloads.result.EXIT_BAD_INPUT` for input only the
    DAG's author can fix (a transform that cannot be imported, a missing input, a missing
    column), so the task fails without retries; 1 when another run kept the output's lease too long.

    :param argv: arguments without the program name.
    """
    spec = parse_args(argv)
    try:
        result = run_preprocess(spec)
    except (ImportError, FileNotFoundError, TypeError, OutputOverlapError, OutputNotOwnedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OutputLeaseBusyError, LeaseLostError) as error:  # another run is replacing the output: retry later
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if (missing := _missing_column(error)) is None:
            raise
        print(f"error: the transform {spec.transform} needs column {missing}, which the input does not have: "
              f"{error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    report_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
