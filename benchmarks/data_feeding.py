"""Data feeding: rows/s of JAX batches from a Ray Data dataset on the CPU, ours vs a naive loop.

Same materialised dataset (``--rows`` rows x 8 float32 feature columns), same batch size, same local
Ray (``ray.init(address="local", num_cpus=1, object_store_memory=150 MiB)``, in a child process so it
does not collide with another Ray on the machine):

- ours: ``airflow_provider_raytpu.workloads.batches.iter_batches(ds, batch_size, "drop")`` (Ray Data's
  ``iter_jax_batches`` with our collate function for the ragged-batch policy);
- naive: ``ds.iter_batches(batch_size=..., batch_format="numpy")`` + ``jnp.asarray`` per column;
- for attribution, Ray's own ``ds.iter_jax_batches(batch_size=..., drop_last=True)`` without our
  collate function.

Every batch is ``jax.block_until_ready``-ed on both sides. One warm-up epoch each, then ``--epochs``
timed epochs, alternating the order; median rows/s, ratio ours/naive (higher is better). The
row count is a multiple of the batch size, so both see every row.

Run: ``.venv/bin/python benchmarks/data_feeding.py [--rows 204800] [--batch-size 1024] [--epochs 5]``
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

FEATURES = 8


def child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import ray

    ray.init(address="local", num_cpus=1, object_store_memory=150 * 1024**2, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    try:
        import jax
        import jax.numpy as jnp
        import ray.data

        from airflow_provider_raytpu.workloads.batches import iter_batches

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False

        def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            rng = np.random.default_rng(int(batch["id"][0]))
            n = len(batch["id"])
            return {f"f{i}": rng.standard_normal(n, dtype=np.float32) for i in range(FEATURES)}

        ds = ray.data.range(args.rows, override_num_blocks=args.blocks).map_batches(features).materialize()

        def ours() -> int:
            rows = 0
            for batch in iter_batches(ds, args.batch_size, "drop"):
                jax.block_until_ready(batch)
                rows += batch["f0"].shape[0]
            return rows

        def naive() -> int:
            rows = 0
            for batch in ds.iter_batches(batch_size=args.batch_size, batch_format="numpy"):
                arrays = {k: jnp.asarray(v) for k, v in batch.items()}
                jax.block_until_ready(arrays)
                rows += arrays["f0"].shape[0]
            return rows

        def ray_jax() -> int:
            rows = 0
            for batch in ds.iter_jax_batches(batch_size=args.batch_size, drop_last=True):
                jax.block_until_ready(batch)
                rows += batch["f0"].shape[0]
            return rows

        loops = {"ours": ours, "naive": naive, "ray_iter_jax_batches": ray_jax}
        rates: dict[str, list[float]] = {name: [] for name in loops}
        rows_seen: dict[str, int] = {}
        for name, fn in loops.items():  # warm-up: compile paths, first object fetches
            rows_seen[name] = fn()
        for epoch in range(args.epochs):
            order = list(loops) if epoch % 2 == 0 else list(reversed(loops))
            for name in order:
                t0 = time.perf_counter()
                rows = loops[name]()
                rates[name].append(rows / (time.perf_counter() - t0))
        return {"rates_rows_per_s": rates, "rows_per_epoch": rows_seen, "jax_backend": jax.default_backend(),
                "jax_version": jax.__version__, "ray_version": ray.__version__,
                "dataset_blocks": ds.num_blocks()}
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=204_800)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16, help="Ray Data blocks of the dataset")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs of each loop")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RAYTPU_FEED " + json.dumps(child(args)), flush=True)
        return

    result = _common.Result("data_feeding", {
        "rows": args.rows, "features": FEATURES, "dtype": "float32", "batch_size": args.batch_size,
        "blocks": args.blocks, "epochs": args.epochs, "policy": "drop",
        "ray": "ray.init(address='local', num_cpus=1, object_store_memory=150 MiB) in a child process",
    })
    # RAY_AUTH_MODE=disabled: with the mode unset, ray.init() of a new local cluster writes ~/.ray/auth_token,
    # and every later Ray process of this user (other engineers' tests, `make demo`) then presents it.
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_DEDUP_LOGS="0", PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    argv = [_common.PYTHON, __file__, "--child", "--rows", str(args.rows), "--batch-size", str(args.batch_size),
            "--blocks", str(args.blocks), "--epochs", str(args.epochs)]
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    started = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(_common.REPO), timeout=1800)
    finally:
        if not had_token and token.exists() and token.stat().st_mtime >= started - 1:
            token.unlink()  # ours: leave no token behind for other Ray users of this account
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RAYTPU_FEED ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"the data feeding child failed ({proc.returncode})")
    out = json.loads(line[len("RAYTPU_FEED "):])
    result["child"] = out
    rates = out["rates_rows_per_s"]
    ours, naive = statistics.median(rates["ours"]), statistics.median(rates["naive"])
    result.add(f"rows/s, {args.rows:,} rows x {FEATURES} float32, batch {args.batch_size}", ours, naive, "rows/s",
               baseline_name="ds.iter_batches + jnp.asarray", lower_is_better=False)
    result.add("batches/s", ours / args.batch_size, naive / args.batch_size, "batches/s",
               baseline_name="ds.iter_batches + jnp.asarray", lower_is_better=False)
    ray_jax = statistics.median(rates["ray_iter_jax_batches"])
    result.add("rows/s vs Ray's own iter_jax_batches (no collate_fn)", ours, ray_jax, "rows/s",
               baseline_name="ds.iter_jax_batches", lower_is_better=False)
    path = result.write()
    result.print_table()
    print(f"  rows per epoch: {out['rows_per_epoch']}; jax backend {out['jax_backend']}")
    print(f"  -> {path.relative_to(_common.REPO)}")


if __name__ == "__main__":
    main()
