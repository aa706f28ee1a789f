"""Side-by-side throughput of training loops that a framework drives (Lightning, transformers.Trainer).

`bench/throughput.py` times loops it writes itself; here the framework owns
the loop, so the timing sits in a step-end callback: every rank of every
system calls `Turns.step_ended()` after each optimizer step. Between two
windows the ranks wait (polling a file) until the orchestrator, `measure`,
says it is their system's turn; a window is `warmup` steps, then `steps`
timed steps on rank 0. The systems start side by side once (start-up is in
no figure) and take turns in a rotating order, so each ratio compares
windows taken seconds apart on the same machine. `step_ended()` returns
True when the orchestrator ends the run: the callback then asks the
framework to stop at that step, on every rank at the same step.

Every wait is bounded (`TURN_TIMEOUT_S`), and a system that fails while
the orchestrator waits for it ends the measurement with its error.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.02
TURN_TIMEOUT_S = 600.0


def _first_of(*paths: str, what: str) -> str:
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while True:
        for p in paths:
            if os.path.exists(p):
                return p
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {TURN_TIMEOUT_S:g} s waiting for {what} ({paths[0]})")
        time.sleep(POLL_S)


class Turns:
    """One rank's side of the windows: count steps, time them (rank 0), wait for the next turn.

    Args:
        system: the system's name in the control folder's file names.
        control: the folder the orchestrator and the ranks share.
        rank, world: this rank and the world size (fixed: the runs measured here never resize).
        steps: timed steps per window; warmup: steps before the timing starts in each window.
        samples_per_step: samples one optimizer step trains over all ranks.
    """

    def __init__(
        self, system: str, control: str, rank: int, world: int, steps: int, warmup: int, samples_per_step: int
    ) -> None:
        self.system, self.control, self.rank, self.world = system, control, rank, world
        self.steps, self.warmup, self.samples_per_step = steps, warmup, samples_per_step
        self.window = 0
        self.count: int | None = None  # None: before the first turn
        self.started = 0.0

    def step_ended(self) -> bool:
        """Called after every optimizer step; True when the run is over (stop training at this step)."""
        if self.count is None:
            if self.rank == 0:
                Path(self.control, f"{self.system}-ready").touch()
            return self._wait_turn()
        self.count += 1
        if self.count == self.warmup:
            self.started = time.perf_counter()
        if self.count < self.warmup + self.steps:
            return False
        elapsed = time.perf_counter() - self.started
        if self.rank == 0:
            done = Path(self.control, f"{self.system}-done-{self.window}")
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"steps_per_s": self.steps / elapsed, "world": self.world}))
            tmp.rename(done)
        self.window += 1
        return self._wait_turn()

    def _wait_turn(self) -> bool:
        go = os.path.join(self.control, f"{self.system}-go-{self.window}")
        end = os.path.join(self.control, f"{self.system}-end")
        if _first_of(go, end, what=f"{self.system}'s turn {self.window}") == end:
            return True
        self.count = 0
        if self.warmup == 0:
            self.started = time.perf_counter()
        return False


def measure(runners: dict[str, Callable[[str], object]], rounds: int, label: str) -> dict[str, list[float]]:
    """Start every runner (`runner(control)`, each in a thread), then give each system one window per round.

    Returns each system's steps/s, one figure per round, in round order.
    """
    import tempfile

    systems = list(runners)
    with tempfile.TemporaryDirectory() as control:
        errors: dict[str, BaseException] = {}

        def run(system: str) -> None:
            try:
                runners[system](control)
            except BaseException as e:  # noqa: BLE001 - handed to the orchestrator, which stops waiting
                errors[system] = e

        threads = {s: threading.Thread(target=run, args=(s,), daemon=True) for s in systems}
        for t in threads.values():
            t.start()

        def wait_for(path: str, system: str, what: str) -> None:
            deadline = time.monotonic() + TURN_TIMEOUT_S
            while not os.path.exists(path):
                if system in errors:
                    raise RuntimeError(f"{system} failed while the orchestrator waited for {what}") from errors[system]
                if not threads[system].is_alive():
                    raise RuntimeError(f"{system} ended while the orchestrator waited for {what}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {TURN_TIMEOUT_S:g} s waiting for {what}")
                time.sleep(POLL_S)

        t0 = time.perf_counter()
        for s in systems:
            wait_for(os.path.join(control, f"{s}-ready"), s, f"{s} to start")
        print(f"{label}: all systems started in {time.perf_counter() - t0:.1f} s", flush=True)
        rates: dict[str, list[float]] = {s: [] for s in systems}
        for rnd in range(rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]  # who goes first rotates
            for s in order:
                Path(control, f"{s}-go-{rnd}").touch()
                done = os.path.join(control, f"{s}-done-{rnd}")
                wait_for(done, s, f"{s}'s window {rnd}")
                rates[s].append(json.loads(Path(done).read_text())["steps_per_s"])
            print(
                f"{label} round {rnd}: " + ", ".join(f"{s} {rates[s][-1]:.1f}" for s in systems) + " steps/s",
                flush=True,
            )
        for s in systems:
            Path(control, f"{s}-end").touch()
        for s, t in threads.items():
            t.join(180)
            if t.is_alive() or s in errors:
                raise RuntimeError(f"{s} did not finish cleanly") from errors.get(s)
        return rates
