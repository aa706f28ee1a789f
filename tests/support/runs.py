"""Running `fit()` from a test: in a thread, up to a step, and reading what its `Result` says.

Shared by the integration tests that train `counting_train_fn` (support/workloads.py) on the session's cluster.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from conftest import wait_until
from workloads import counting_train_fn

from ray_elastic import ElasticTrainer


def sizes(result) -> list[int]:
    """The world sizes rank 0 trained at, in order, repeats collapsed."""
    out: list[int] = []
    for m in result.metrics_history:
        if not out or out[-1] != m["world_size"]:
            out.append(m["world_size"])
    return out


def fit_in_thread(trainer: ElasticTrainer | Any) -> Future:
    """`trainer.fit()` in a thread (an `ElasticTrainer`, or `ray_elastic.train`'s trainers): its result or error."""
    fut: Future = Future()

    def target() -> None:
        try:
            fut.set_result(trainer.fit())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            fut.set_exception(e)

    threading.Thread(target=target, daemon=True).start()
    return fut


def start_and_reach_step(tmp_path, config: dict, step: int = 20, **trainer_kwargs) -> Future:
    """Start fit() in a thread and return once rank 0 has trained `step` steps."""
    signal_file = tmp_path / "reached"
    trainer_kwargs.setdefault("min_workers", 2)
    trainer_kwargs.setdefault("max_workers", 4)
    fut = fit_in_thread(
        ElasticTrainer(
            counting_train_fn,
            config={**config, "signal_file": str(signal_file), "signal_step": step},
            verbose=0,
            **trainer_kwargs,
        )
    )
    wait_until(lambda: signal_file.exists() or fut.done(), 90, f"rank 0 to reach step {step}")
    if not signal_file.exists():  # fit() ended first: its own error says why (e.g. workers too slow to boot)
        fut.result()
        raise AssertionError(f"fit() returned before rank 0 reached step {step}")
    return fut


def assert_same_state(result) -> None:
    digests = result.return_value["digests"]
    assert len(digests) == result.return_value["world_size"]
    assert len(set(digests)) == 1, f"ranks diverged: {digests}"


def fault(tmp_path, rank: int, step: int, action: str = "sigkill", name: str = "fault") -> dict:
    return {"rank": rank, "step": step, "action": action, "marker": str(tmp_path / f"{name}-{rank}-{step}")}
