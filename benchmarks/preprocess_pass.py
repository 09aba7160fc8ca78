"""The preprocessing job's workload against a hand-written Ray Data pipeline doing the same work, on the same data.

- ours: ``workloads.preprocess.run_preprocess`` as a ``RayDataOperator`` job runs it: read, the transform,
  write to parquet (replacing its task's earlier output), rows in and out counted in that one pass;
- baseline: ``ray.data.read_json(...).map_batches(transform).write_parquet(...)`` written by hand, counting nothing;
- before: the workload as it was at 7a74283 (``source.count()``, then transform and write, then a count of
  the output read back), re-enacted with the same modules, for the bytes it read.

Storage is fake-gcs-server behind a TLS proxy on 127.0.0.1 (a trustme CA that every Ray worker trusts
through ``SSL_CERT_FILE``, as a real client trusts Google's): every object byte crosses TLS, as it does
from a GKE node to GCS. The proxy counts the object bytes each run downloads. Ray runs locally
(``num_cpus=2``, 300 MiB object store), in this process, for all three, in rotating order each round.

Figures: rows/s (rows of the input over the run's wall time; median of the rounds, ratio ours/baseline:
goal >= 0.95) and bytes of the input object read / its size (goal 1.0), all measured. The input is
JSONL (no row-count metadata), the transform ``example_dags.pipeline.transforms:normalise`` (a function:
Ray tasks), or ``Embedder`` with ``--transform Embedder`` (a class: an actor pool).

Run: ``.venv/bin/python benchmarks/preprocess_pass.py [--rows 1000000] [--rounds 3] [--transform normalise]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import _common

BUCKET = "bench"
INPUT = "raw/rows.jsonl"
TRANSFORMS = {"normalise": "example_dags.pipeline.transforms:normalise",
              "Embedder": "example_dags.pipeline.transforms:Embedder"}


class CountingTlsProxy:
    """An HTTPS reverse proxy in front of fake-gcs-server (plain HTTP), counting the object bytes it serves.

    It runs in a process of its own: pyarrow may hold this process's GIL while it waits for a read.
    ``GET /_bench/downloaded`` answers the bytes served per object since the last ``DELETE`` of it.

    :param upstream: fake-gcs-server's URL.
    :param port: the port to listen on.
    :param certificates: a directory for the CA and server certificate (``ca.pem`` is what clients trust).
    """

    def __init__(self, upstream: str, port: int, certificates: Path) -> None:
        import trustme

        self.upstream, self.port = upstream, port
        authority = trustme.CA()
        self.ca_file = certificates / "ca.pem"
        authority.cert_pem.write_to_path(str(self.ca_file))
        self.chain_file = certificates / "server.pem"
        authority.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
            str(self.chain_file))
        self.process: Any = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        import multiprocessing

        self.process = multiprocessing.get_context("spawn").Process(
            target=serve_proxy, args=(self.upstream, self.port, str(self.chain_file)), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.downloaded()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.join()

    def _call(self, method: str) -> Any:
        import json
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(f"{self.url}/_bench/downloaded", method=method)
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return json.load(answer)

    def downloaded(self) -> dict[str, int]:
        return self._call("GET")

    def reset(self) -> None:
        self._call("DELETE")


def serve_proxy(upstream: str, port: int, chain_file: str) -> None:
    """The proxy process: TLS on 127.0.0.1:``port``, every request forwarded to ``upstream``."""
    import ssl

    from aiohttp import ClientSession, TCPConnector, web

    downloaded: Counter[str] = Counter()
    skip = {"host", "content-length", "transfer-encoding", "connection"}

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path == "/_bench/downloaded":
            if request.method == "DELETE":
                downloaded.clear()
            return web.json_response(dict(downloaded))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        async with request.app["session"].request(request.method, upstream + request.path_qs, headers=headers,
                                                  data=await request.read()) as answer:
            body = await answer.read()
            if request.method == "GET" and request.query.get("alt") == "media":
                downloaded[urllib.parse.unquote(request.path.rsplit("/o/", 1)[-1])] += len(body)
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in skip | {"content-encoding"}}
            return web.Response(status=answer.status, headers=kept, body=body)

    async def session(app: web.Application) -> Any:
        app["session"] = ClientSession(auto_decompress=False, connector=TCPConnector(limit=0))
        yield
        await app["session"].close()

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(chain_file)
    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{path:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=context, access_log=None, print=None)


def hand_written(input_uri: str, output_uri: str, transform: str) -> None:
    """The pipeline as a Ray Data user writes it."""
    import ray.data

    from airflow_provider_raytpu.workloads.loading import load_object
    from airflow_provider_raytpu.workloads.storage import resolve

    source, target, function = resolve(input_uri), resolve(output_uri), load_object(transform)
    options = ({"compute": ray.data.ActorPoolStrategy(size=1)} if isinstance(function, type) else {})
    dataset = ray.data.read_json(source.path, filesystem=source.filesystem)
    dataset.map_batches(function, batch_format="numpy", **options).write_parquet(target.path,
                                                                                  filesystem=target.filesystem)


def before(input_uri: str, output_uri: str, transform: str) -> None:
    """7a74283's run_preprocess: count the input, transform and write, count the output read back."""
    import ray.data

    from airflow_provider_raytpu.workloads.datasets import read_dataset, write_parquet_replacing
    from airflow_provider_raytpu.workloads.loading import load_object

    function = load_object(transform)
    options = ({"compute": ray.data.ActorPoolStrategy(size=1)} if isinstance(function, type) else {})
    source = read_dataset(input_uri, "jsonl")
    source.count()
    target, _, _ = write_parquet_replacing(source.map_batches(function, batch_format="numpy", **options),
                                           output_uri, "bench")
    read_dataset(target.uri, "parquet").count()


def ours(input_uri: str, output_uri: str, transform: str) -> None:
    from airflow_provider_raytpu.workloads.preprocess import PreprocessSpec, run_preprocess

    result = run_preprocess(PreprocessSpec(input_uri, output_uri, transform, input_format="jsonl", owner="bench"))
    assert result["rows_in"] == result["rows_out"], result


VARIANTS = {"ours": ours, "hand-written": hand_written, "before": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transform", choices=sorted(TRANSFORMS), default="normalise")
    args = parser.parse_args()
    result = _common.Result("preprocess_pass", vars(args))

    import ray
    import ray.data

    from example_dags.demo.fake_gcs import FakeGcsServer, _free_port
    from example_dags.pipeline.data import write_dataset

    certificates = Path(tempfile.mkdtemp(prefix="raytpu-bench-tls-"))
    port = _free_port()
    server = FakeGcsServer(external_url=f"https://127.0.0.1:{port}")
    server.start()
    proxy = CountingTlsProxy(server.url, port, certificates)
    proxy.start()
    env = {**server.env(), "STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url,
           "SSL_CERT_FILE": str(proxy.ca_file), "PYTHONPATH": str(_common.REPO), "JAX_PLATFORMS": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_DATA_USAGE_DISABLED": "1"}
    os.environ.update(env)
    try:
        server.create_bucket(BUCKET)
        input_uri = write_dataset(f"gs://{BUCKET}/{INPUT}", args.rows, seed=1, fmt="jsonl")
        size = len(server.read_object(BUCKET, INPUT))
        ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
        ray.data.DataContext.get_current().enable_progress_bars = False
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for round_ in range(args.rounds + 1):  # round 0 warms the workers' imports; not counted
            for name in names[round_ % 3:] + names[:round_ % 3]:
                proxy.reset()
                started = time.perf_counter()
                VARIANTS[name](input_uri, f"gs://{BUCKET}/out/{name}-{round_}", TRANSFORMS[args.transform])
                seconds = time.perf_counter() - started
                downloaded = proxy.downloaded()
                if round_:
                    runs[name].append({"seconds": seconds, "input_bytes": downloaded.get(INPUT, 0),
                                       "all_bytes": sum(downloaded.values())})
                print(f"  round {round_} {name}: {seconds:.2f} s, input read {downloaded.get(INPUT, 0) / size:.2f}x",
                      flush=True)
        ray.shutdown()
    finally:
        proxy.stop()
        server.stop()
    result["runs"], result["input_bytes"] = runs, size
    rate = {name: args.rows / statistics.median(r["seconds"] for r in runs[name]) for name in runs}
    read = {name: statistics.median(r["input_bytes"] for r in runs[name]) / size for name in runs}
    label = f"{args.transform}, {args.rows} JSONL rows ({size / 2**20:.0f} MiB) over TLS"
    result.add(f"preprocess rows/s ({label})", round(rate["ours"]), round(rate["hand-written"]), "rows/s",
               baseline_name="hand-written read_json -> map_batches -> write_parquet", lower_is_better=False)
    result.add("input bytes read / input size", read["ours"], read["hand-written"], "x",
               baseline_name="hand-written")
    result.add("input bytes read / input size, before (7a74283)", read["before"], read["hand-written"], "x",
               baseline_name="hand-written")
    result.add("preprocess rows/s, before (7a74283)", round(rate["before"]), round(rate["hand-written"]), "rows/s",
               baseline_name="hand-written", lower_is_better=False)
    result.goal("one pass over the input", [
        ("hand-written rows/s / ours", rate["hand-written"] / rate["ours"], 1 / 0.95, "x"),
        ("input bytes read / input size", read["ours"], 1.0, "x"),
    ])
    result.finish()


if __name__ == "__main__":
    main()
