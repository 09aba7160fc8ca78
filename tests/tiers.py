"""`make test`'s tiers in two lanes, each tier's output kept whole.

Lane 1 builds the control plane (under ``nice``: a no-op once built) and runs the control-plane
tier, then the Ray tier's JaxTrainer runs on multi-host slices (``test-ray-training``, the tests
that kill a host last); lane 2 runs the unit, fake-API and deployment tiers and the rest of the
Ray tier (``test-ray-rest``) beside it. The control-plane tier mostly waits for Kubernetes and
keeps a 2-core machine half busy, so the deployment tier fits beside it; the whole Ray tier beside
it kept the machine 95 % busy and hung a multi-slice training job after a lost host
(tests/README.md), so the training part starts only when the control-plane tier has ended, and
its host-loss tests run last, when lane 2 has ended or nearly.

A tier's output goes to ``build/test-logs/<tier>.log`` and is printed whole when the tier ends,
with its elapsed time; while tiers run, a line every two minutes says where each one is. The exit
code is non-zero when any tier failed; every tier runs to its end either way.

Run it through ``make test``; ``RAYTPU_TEST_LANES=1`` runs every tier in one lane.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_DIR = REPO / "build" / "test-logs"
HEARTBEAT_SECONDS = 120.0
TIER_MARKER = "RAYTPU_TEST_TIER"  # in every process a tier starts, to find the ones left running
BUDGET = "45 min with the control plane's binaries cached, 60 min on a fresh machine"


@dataclass
class Tier:
    """One tier: the commands it runs in order (``make`` targets) and, once run, how it went."""

    name: str
    commands: list[list[str]]
    returncode: int | None = None
    started: float = 0.0
    elapsed: float = 0.0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = LOG_DIR / f"{self.name}.log"

    @property
    def result(self) -> str:
        if self.returncode is None:
            return "not run"
        return "passed" if self.returncode == 0 else f"FAILED (exit {self.returncode})"


def lanes(make: str, count: int) -> list[list[Tier]]:
    """The tiers by lane: the control plane's builds, its tier and the Ray tier's training part; beside them
    the light tiers, the deployment tier and the rest of the Ray tier."""
    target = [make, "--no-print-directory"]
    first = [
        Tier("controlplane", [["nice", "-n", "10", *target, "k8s-binaries", "kueue"], [*target, "test-controlplane"]]),
        Tier("ray-training", [[*target, "test-ray-training"]]),
    ]
    second = [Tier("unit", [[*target, "test-unit"]]), Tier("fakeapi", [[*target, "test-fakeapi"]]),
              Tier("deployment", [[*target, "test-deployment"]]), Tier("ray-rest", [[*target, "test-ray-rest"]])]
    return [first, second] if count > 1 else [second + first]


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def stop_leftovers(marker: str) -> int:
    """SIGKILL every process whose environment carries ``marker``: what a tier left behind, e.g. the control
    plane's pods, in sessions of their own, after pytest-timeout ended a hung pytest with ``os._exit``.

    :return: how many processes were stopped.
    """
    import psutil

    stopped = 0
    for process in psutil.process_iter():
        try:
            if process.environ().get(TIER_MARKER) == marker:
                process.kill()
                stopped += 1
        except psutil.Error:
            continue
    return stopped


def last_line(path: Path) -> str:
    """The tier's latest progress line (pytest's dots and percentage), or its latest line."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-100:] if lines else ""


class Lanes:
    """Runs each lane's :class:`Tier` s in order on a thread of its own, printing each tier's log whole as it ends."""

    def __init__(self, lanes: list[list[Tier]]) -> None:
        self.lanes = lanes
        self.tiers = [tier for lane in lanes for tier in lane]
        self.print_lock = threading.Lock()
        self.done = threading.Event()

    def say(self, text: str) -> None:
        with self.print_lock:
            print(text, flush=True)

    def run_tier(self, tier: Tier) -> None:
        tier.started = time.monotonic()
        self.say(f"== {tier.name}: started")
        returncode = 0
        marker = f"{tier.name}-{os.getpid()}"
        with open(tier.log, "wb") as log:
            for command in tier.commands:
                returncode = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, TIER_MARKER: marker}
                                            ).returncode
                if returncode:
                    break
        left = stop_leftovers(marker)
        tier.returncode = returncode
        tier.elapsed = time.monotonic() - tier.started
        with self.print_lock:
            sys.stdout.write(tier.log.read_text(errors="replace"))
            if left:
                print(f"== {tier.name}: stopped {left} process(es) it left running", flush=True)
            print(f"== {tier.name}: {tier.result} in {minutes(tier.elapsed)}", flush=True)

    def lane(self, tiers: list[Tier]) -> None:
        for tier in tiers:
            self.run_tier(tier)

    def heartbeat(self, began: float) -> None:
        while not self.done.wait(HEARTBEAT_SECONDS):
            running = [t for t in self.tiers if t.started and t.returncode is None]
            self.say(f"-- {minutes(time.monotonic() - began)}: " + "; ".join(
                f"{t.name} {minutes(time.monotonic() - t.started)} [{last_line(t.log)}]" for t in running))

    def run(self) -> int:
        began = time.monotonic()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self.heartbeat, args=(began,), daemon=True).start()
        threads = [threading.Thread(target=self.lane, args=(lane,)) for lane in self.lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.done.set()
        print("\n| tier | result | elapsed |\n| --- | --- | --- |")
        for tier in self.tiers:
            print(f"| {tier.name} | {tier.result} | {minutes(tier.elapsed)} |")
        print(f"tiers: {minutes(time.monotonic() - began)} on {len(self.lanes)} lane(s) (make test's budget: {BUDGET})")
        return 0 if all(t.returncode == 0 for t in self.tiers) else 1


def main() -> int:
    make = os.environ.get("MAKE", "make")
    count = int(os.environ.get("RAYTPU_TEST_LANES", "2"))
    return Lanes(lanes(make, count)).run()


if __name__ == "__main__":
    sys.exit(main())
