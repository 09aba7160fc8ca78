"""What ``pip install airflow-provider-raytpu`` (the base package, no extras) puts on an Airflow image.

Ours is this checkout's committed tree (``git archive HEAD``); the baseline is the last commit whose base
dependencies still had ``ray[default]`` (``--baseline``, default ``c610eb8``: before issue 25, item 1).
Each side is installed into a fresh virtualenv (``python -m venv``) with its own ``constraints.txt``,
in alternating rounds:

- ``uv pip install -c constraints.txt <tree>`` (as ``make install`` does; uv's cache is warm on this
  machine, so the time is mostly unpacking and linking);
- with ``--pip``, also ``pip install --no-cache-dir -c constraints.txt <tree>`` (downloads every wheel
  from the index: the time of a cold image build; slow, off by default).

Figures: install seconds (median of the rounds), site-packages size (MiB, ``du``), distributions
installed, and whether ``ray`` is importable. All measured.

Run: ``.venv/bin/python benchmarks/base_install.py [--rounds 2] [--pip] [--baseline REF]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

UV = Path(sys.executable).parent / "uv"


def tree(ref: str, into: Path) -> Path:
    """The committed tree at ``ref``, unpacked (what a user's ``pip install`` of that release builds)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(_common.REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def install(tool: str, source: Path, venv: Path) -> dict[str, Any]:
    """One fresh virtualenv with ``source`` installed by ``tool``: seconds, MiB, distributions, ray."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    constraints = str(source / "constraints.txt")
    command = ([str(UV), "pip", "install", "--quiet", "--python", str(python), "-c", constraints, str(source)]
               if tool == "uv" else
               [str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir", "-c", constraints, str(source)])
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=venv.parent)
    seconds = time.monotonic() - started
    (site,) = (venv / "lib").glob("python*/site-packages")
    mib = int(subprocess.run(["du", "-sm", str(site)], check=True, capture_output=True, text=True).stdout.split()[0])
    has_ray = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('ray') is not None)"],
                             check=True, capture_output=True, text=True, cwd=venv.parent).stdout.strip() == "True"
    return {"seconds": seconds, "site_packages_mib": mib, "distributions": len(list(site.glob("*.dist-info"))),
            "ray": has_ray}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds of the uv install")
    parser.add_argument("--pip", action="store_true", help="also pip --no-cache-dir, once per side (slow: downloads)")
    parser.add_argument("--baseline", default="c610eb8", help="a commit whose base dependencies had ray[default]")
    args = parser.parse_args()
    result = _common.Result("base_install", vars(args))
    baseline_name = f"{args.baseline}: ray[default] in the base dependencies"
    with tempfile.TemporaryDirectory(prefix="raytpu-install-") as scratch:
        work = Path(scratch)
        sources = {"ours": tree("HEAD", work / "ours"), "baseline": tree(args.baseline, work / "baseline")}
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {"uv": {"ours": [], "baseline": []}, "pip": {
            "ours": [], "baseline": []}}
        tools = [("uv", args.rounds)] + ([("pip", 1)] if args.pip else [])
        for tool, rounds in tools:
            for round_ in range(rounds):
                for side in ("baseline", "ours") if round_ % 2 == 0 else ("ours", "baseline"):
                    samples[tool][side].append(install(tool, sources[side], work / f"{tool}-{side}-{round_}"))
        result["samples"] = samples
    for tool, label in (("uv", "uv pip install (warm cache)"), ("pip", "pip install --no-cache-dir")):
        ours, base = samples[tool]["ours"], samples[tool]["baseline"]
        if not ours:
            continue
        result.add(f"{label}: seconds, median of {len(ours)}", statistics.median(s["seconds"] for s in ours),
                   statistics.median(s["seconds"] for s in base), "s", baseline_name=baseline_name)
        result.add(f"{label}: site-packages", ours[0]["site_packages_mib"], base[0]["site_packages_mib"], "MiB",
                   baseline_name=baseline_name)
        result.add(f"{label}: distributions installed", ours[0]["distributions"], base[0]["distributions"], "",
                   baseline_name=baseline_name)
        result.add(f"{label}: ray importable (1 = yes)", int(ours[0]["ray"]), int(base[0]["ray"]), "",
                   baseline_name=baseline_name)
    result.finish()


if __name__ == "__main__":
    main()
