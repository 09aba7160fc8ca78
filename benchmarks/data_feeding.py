"""Data feeding: rows/s of sharded JAX batches from Ray Data on 4 emulated devices, ours vs Ray's iter_jax_batches.

Every loop below (but the reference) yields the same arrays - each column a global array sharded by
rows over Ray's 1-D ``data`` mesh of 4 JAX CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``)
- checked value for value and sharding for sharding on the first batch of every size:

- ours: ``airflow_provider_raytpu.workloads.batches.iter_batches(ds, batch_size, "drop")``;
- ray: Ray's own ``ds.iter_jax_batches(batch_size=..., drop_last=True)`` (the baseline; Ray 2.60,
  ``ray/data/iterator.py`` and ``ray/data/util/jax_util.py``: one ``make_array_from_process_local_data``
  per column);
- hand: ``ds.iter_batches(batch_format="numpy")`` + ``jax.make_array_from_process_local_data`` per
  column with the same sharding, as the JAX docs show it (the same work written by hand);
- hand_tree: the same, but one ``make_array_from_process_local_data`` call for the whole batch dict;
- naive (reference, not the same work): ``ds.iter_batches`` + ``jnp.asarray`` per column, which makes
  uncommitted single-device arrays;
- delivery (a floor): the numpy batches our fast path reads from Ray Data, with no transfer at all.

Each size is ``--columns`` float32 tensor columns of ``bytes per column / (4 * rows)`` values per row,
``--batch-size`` rows per batch, a materialised dataset of about ``--epoch-mib`` MiB (at least 3,
at most ``--max-batches`` batches) in blocks of whole batches of at most 64 MiB. Every batch is
``jax.block_until_ready``-ed. One warm-up epoch per loop, then ``--rounds`` rounds; each round runs
every loop once in a rotated order; a ratio is the median over rounds of the round's ratio (paired
runs). The whole measurement runs ``--runs`` times, each in a fresh process with its own Ray; the
table gives the median over runs of each run's figure.

With a train step: a jitted data-parallel step (2-layer MLP, hidden ``--hidden``, on all features,
SGD; parameters replicated, batch sharded) consumes each batch; the loop keeps at most one step in
flight (it blocks on the previous step's loss after dispatching the next). *Data wait* is the time
the loop spends in ``next()`` of the batch iterator, as a share of the epoch: an upper bound on the
time the devices wait for data. On this CPU host the step and the feeding share the same cores, so
the table also gives, per batch, the feeding time (derived from our rows/s) next to the step's time
alone (the same steps on batches already on the devices): on a TPU host, where the step runs on the
chips, feeding that takes less time than the step is hidden behind it.

Run: ``.venv/bin/python benchmarks/data_feeding.py [--sizes 8x64K,128x64K,...] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common

DEVICES = 4
DEFAULT_SIZES = "8x4K,8x64K,8x512K,8x4M,128x4K,128x64K,128x512K"
LOOPS = ("ours", "ray", "hand", "hand_tree", "naive", "delivery")


def parse_size(text: str) -> tuple[int, int]:
    """``"8x64K"`` -> (8 columns, 65536 bytes per column per batch)."""
    columns, size = text.lower().split("x")
    scale = {"k": 1024, "m": 1024**2}.get(size[-1], 1)
    return int(columns), int(size.rstrip("km")) * scale


def child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import ray

    ray.init(address="local", num_cpus=1, object_store_memory=args.object_store_mib * 1024**2,
             include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        import jax

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if jax.local_device_count() != DEVICES:
            raise SystemExit(f"expected {DEVICES} devices, got {jax.local_device_count()} (XLA_FLAGS)")
        out = {"sizes": [run_size(args, *parse_size(s)) for s in args.sizes.split(",")]}
        out.update(jax_backend=jax.default_backend(), jax_version=jax.__version__, ray_version=ray.__version__,
                   numpy_version=np.__version__, devices=jax.local_device_count())
        return out
    finally:
        ray.shutdown()


def make_dataset(columns: int, bytes_per_column: int, batch_size: int, epoch_mib: int, max_batches: int) -> Any:
    import numpy as np
    import ray.data

    width = max(1, bytes_per_column // (4 * batch_size))
    batch_bytes = columns * width * 4 * batch_size
    batches = max(3, min(max_batches, epoch_mib * 1024**2 // batch_bytes))
    rows = batches * batch_size
    per_block = max(1, min(batches, (64 * 1024**2) // batch_bytes))  # blocks of whole batches, <= ~64 MiB

    def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(int(batch["id"][0]))
        n = len(batch["id"])
        shape = (n,) if width == 1 else (n, width)
        return {f"f{i}": rng.standard_normal(shape, dtype=np.float32) for i in range(columns)}

    blocks = -(-batches // per_block)
    ds = ray.data.range(rows, override_num_blocks=blocks).map_batches(features, batch_size=per_block * batch_size)
    return ds.materialize(), width, rows, batches


def loops(ds: Any, batch_size: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from airflow_provider_raytpu.workloads.batches import iter_batches
    from airflow_provider_raytpu.workloads.block_batches import numpy_batches as fast_path_numpy_batches

    # The sharding Ray builds (jax_util.py, _create_sharding_1d), written out.
    sharding = NamedSharding(Mesh(mesh_utils.create_device_mesh((jax.device_count(),)), ("data",)),
                             PartitionSpec("data"))

    def numpy_batches() -> Any:
        return ds.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True)

    def hand() -> Any:
        for batch in numpy_batches():
            yield {k: jax.make_array_from_process_local_data(sharding, v, v.shape) for k, v in batch.items()}

    def hand_tree() -> Any:
        for batch in numpy_batches():
            yield jax.make_array_from_process_local_data(sharding, batch, {k: v.shape for k, v in batch.items()})

    def naive() -> Any:
        for batch in numpy_batches():
            yield {k: jnp.asarray(v) for k, v in batch.items()}

    return {
        "ours": lambda: iter_batches(ds, batch_size, "drop"),
        "ray": lambda: ds.iter_jax_batches(batch_size=batch_size, drop_last=True),
        "hand": hand,
        "hand_tree": hand_tree,
        "naive": naive,
        "delivery": lambda: fast_path_numpy_batches(ds, batch_size, True, 1),
    }


def feed_epoch(make: Any) -> tuple[int, float]:
    import jax

    rows, start = 0, time.perf_counter()
    for batch in make():
        jax.block_until_ready(batch)
        rows += batch["f0"].shape[0]
    return rows, time.perf_counter() - start


def same_arrays(made: dict[str, Any]) -> bool:
    import numpy as np

    first = {name: next(iter(made[name]())) for name in ("ours", "ray", "hand", "hand_tree")}
    reference = first["ray"]
    return all(  # hand_tree's dict comes back from the pytree call in sorted key order: compare by key
        sorted(batch) == sorted(reference) and list(first["ours"]) == list(reference)
        and all(batch[k].sharding == reference[k].sharding and batch[k].dtype == reference[k].dtype
                and np.array_equal(np.asarray(batch[k]), np.asarray(reference[k])) for k in batch)
        for batch in first.values()
    )


def train_step(columns: int, width: int, hidden: int) -> tuple[Any, Any]:
    """A jitted data-parallel SGD step of a 2-layer MLP over all feature columns, and its initial parameters."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    features = columns * width
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((features, hidden), np.float32) / np.sqrt(features)),
              "w2": jnp.asarray(rng.standard_normal((hidden, 1), np.float32) / np.sqrt(hidden))}

    def loss(p: dict[str, Any], batch: dict[str, Any]) -> Any:
        x = jnp.concatenate([batch[f"f{i}"].reshape(batch[f"f{i}"].shape[0], -1) for i in range(columns)], axis=1)
        target = x[:, 0]
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - target[:, None]) ** 2)

    @jax.jit
    def step(p: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        value, grads = jax.value_and_grad(loss)(p, batch)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads), value

    return step, params


def train_epoch(batches: Any, step: Any, params: Any) -> dict[str, float]:
    """One epoch, at most one step in flight; returns the epoch time and the time spent in next()."""
    import jax

    wait, start, previous, steps = 0.0, time.perf_counter(), None, 0
    iterator = iter(batches)
    while True:
        t0 = time.perf_counter()
        batch = next(iterator, None)
        wait += time.perf_counter() - t0
        if batch is None:
            break
        params, loss = step(params, batch)
        steps += 1
        if previous is not None:
            jax.block_until_ready(previous)
        previous = loss
    jax.block_until_ready(params)
    return {"epoch_s": time.perf_counter() - start, "wait_s": wait, "steps": steps}


def run_size(args: argparse.Namespace, columns: int, bytes_per_column: int) -> dict[str, Any]:
    import jax

    ds, width, rows, batches = make_dataset(columns, bytes_per_column, args.batch_size, args.epoch_mib,
                                            args.max_batches)
    made = loops(ds, args.batch_size)
    result: dict[str, Any] = {"columns": columns, "bytes_per_column": bytes_per_column, "width": width,
                              "rows": rows, "batches": batches, "batch_mib": columns * bytes_per_column / 2**20}
    result["same_arrays"] = same_arrays(made)
    rates: dict[str, list[float]] = {name: [] for name in LOOPS}
    for name in LOOPS:  # warm-up: compiled splits, first object fetches
        feed_epoch(made[name])
    for r in range(args.rounds):
        order = LOOPS[r % len(LOOPS):] + LOOPS[:r % len(LOOPS)]
        for name in order:
            n, seconds = feed_epoch(made[name])
            rates[name].append(n / seconds)
    result["rows_per_s"] = rates

    step, params = train_step(columns, width, args.hidden)
    on_device = list(made["ours"]())
    train_epoch(on_device, step, params)  # compile
    trained: dict[str, list[dict[str, float]]] = {"ours": [], "ray": [], "compute_only": []}
    for r in range(args.rounds):
        order = ["ours", "ray", "compute_only"] if r % 2 == 0 else ["compute_only", "ray", "ours"]
        for name in order:
            batches_iter = on_device if name == "compute_only" else made[name]()
            trained[name].append(train_epoch(batches_iter, step, params))
    result["train"] = trained
    del on_device
    jax.clear_caches()
    return result


def summarise(result: _common.Result, runs: list[list[dict[str, Any]]], batch_size: int) -> None:
    """Summary rows: for each size, the median over runs of each run's figure."""
    median = statistics.median
    for sizes in zip(*runs, strict=True):
        first = sizes[0]
        label = f"{first['columns']} cols x {_size(first['bytes_per_column'])}/col ({first['batch_mib']:.3g} MiB batch)"
        how = f"measured; median of {len(runs)} runs; ratio: of {len(first['rows_per_s']['ours'])} paired rounds each"
        ours = median(median(s["rows_per_s"]["ours"]) for s in sizes)
        for base, name in (("ray", "Ray's iter_jax_batches"), ("hand", "hand loop, make_array per column"),
                           ("hand_tree", "hand loop, one make_array call"),
                           ("naive", "naive jnp.asarray, unsharded: reference"),
                           ("delivery", "Ray Data's numpy batches alone, no transfer: floor")):
            result.add(f"{label}: rows/s", ours, median(median(s["rows_per_s"][base]) for s in sizes), "rows/s",
                       baseline_name=name, lower_is_better=False, how=how)
            result.data["summary"][-1]["ratio"] = median(
                median(o / b for o, b in zip(s["rows_per_s"]["ours"], s["rows_per_s"][base], strict=True))
                for s in sizes)
        share = {name: 100 * median(median(t["wait_s"] / t["epoch_s"] for t in s["train"][name]) for s in sizes)
                 for name in ("ours", "ray")}
        result.add(f"{label}: data wait with the train step, % of epoch", share["ours"], share["ray"], "%",
                   baseline_name="Ray's iter_jax_batches", how=f"measured; median of {len(runs)} runs")
        step_ms = 1000 * median(median(t["epoch_s"] / t["steps"] for t in s["train"]["compute_only"]) for s in sizes)
        result.add(f"{label}: feeding vs the train step, per batch", 1000 * batch_size / ours, step_ms, "ms",
                   baseline_name="the step alone, batches on the devices",
                   how="derived: feeding = batch rows / our rows/s; step measured")


def _size(n: int) -> str:
    return f"{n // 1024**2} MiB" if n >= 1024**2 else f"{n // 1024} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="COLUMNSxBYTES per column per batch, comma-separated")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch (divisible by 4 devices)")
    parser.add_argument("--epoch-mib", type=int, default=128, help="dataset size per size (at least 3 batches)")
    parser.add_argument("--max-batches", type=int, default=256, help="at most this many batches per epoch")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (each runs every loop once)")
    parser.add_argument("--runs", type=int, default=3, help="whole measurements, each in a fresh process")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units of the train step's MLP")
    parser.add_argument("--object-store-mib", type=int, default=512)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RAYTPU_FEED " + json.dumps(child(args)), flush=True)
        return

    parameters = {k: v for k, v in vars(args).items() if k not in ("child", "runs")}
    result = _common.Result("data_feeding", {
        **parameters, "devices": DEVICES, "dtype": "float32", "policy": "drop",
        "ray": f"ray.init(address='local', num_cpus=1, object_store_memory={args.object_store_mib} MiB) in a child "
               f"process with XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}",
        "baseline_source": "ray/data/iterator.py DataIterator.iter_jax_batches + ray/data/util/jax_util.py "
                           "(Ray 2.60)",
    })
    # RAY_AUTH_MODE=disabled: with the mode unset, ray.init() of a new local cluster writes ~/.ray/auth_token,
    # and every later Ray process of this user (other engineers' tests, `make demo`) then presents it.
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_DEDUP_LOGS="0", PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    argv = [_common.PYTHON, __file__, "--child"] + [
        token for k, v in parameters.items() for token in (f"--{k.replace('_', '-')}", str(v))]
    outs = [run_child(argv, env) for _ in range(args.runs)]
    result["runs"] = outs
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    same = [s["same_arrays"] for out in outs for s in out["sizes"]]
    if not all(same):
        result["error"] = "the loops did not produce the same arrays"
    summarise(result, [out["sizes"] for out in outs], args.batch_size)
    path = result.write()
    result.print_table()
    print(f"  same arrays in every loop but naive and delivery: {all(same)} ({len(same)} checks); "
          f"jax backend {outs[0]['jax_backend']} x {outs[0]['devices']}")
    print(f"  -> {path.relative_to(_common.REPO)}")


def run_child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One whole measurement in a fresh process (its own Ray and JAX)."""
    load = [round(x, 2) for x in os.getloadavg()]
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    started = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(_common.REPO), timeout=3600)
    finally:
        if not had_token and token.exists() and token.stat().st_mtime >= started - 1:
            token.unlink()  # ours: leave no token behind for other Ray users of this account
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RAYTPU_FEED ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"the data feeding child failed ({proc.returncode})")
    return {**json.loads(line[len("RAYTPU_FEED "):]), "load_average_at_start": load,
            "seconds": round(time.time() - started, 1)}


if __name__ == "__main__":
    main()
