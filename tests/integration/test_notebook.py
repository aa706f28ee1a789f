"""Jupyter: `examples/notebook.ipynb` in a real IPython kernel against a `ray start --head` cluster.

The kernel runs the venv's Python (the "python3" kernel of ipykernel, which
jupyter_client starts with `sys.executable`) in `examples/`, with the
cluster's address and token in its environment, as a user's shell would
have them. One test runs the whole notebook; the other interrupts the kernel
during a long `fit()` and checks, through Ray's state API, that the run's
actors and placement groups are gone while the cluster stays up.
"""

from __future__ import annotations

import queue
import re
import time
from pathlib import Path

import nbformat
import pytest
from conftest import wait_until
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"


def kernel_env(cluster) -> dict[str, str]:
    return {**cluster.env, "RAY_ADDRESS": cluster.address}


def output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_notebook_trains_on_a_running_cluster(ray_start_cluster):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute(env=kernel_env(ray_start_cluster))
    code = [c for c in nb.cells if c.cell_type == "code"]
    connect, fit, summary, plot, timeline = code
    assert re.search(rf"connected to [\d.]+:{ray_start_cluster.gcs_port} with 3.0 CPUs", output_text(connect))
    assert re.search(r"\[ray-elastic\] started with 3 workers", output_text(fit)), output_text(fit)
    text = output_text(summary)
    accuracy = re.search(r"test accuracy ([\d.]+) after \d+ steps on 3 workers", text)
    assert accuracy and float(accuracy.group(1)) > 0.85, text
    assert "ranks held equal state after every sync: True" in text
    assert re.search(r"^start\s+world size 3", text, re.MULTILINE), text
    assert any("image/png" in out.get("data", {}) for out in plot.outputs), "the loss plot was not drawn"
    assert any("image/png" in out.get("data", {}) for out in timeline.outputs), "the timeline was not shown"
    wait_until(lambda: not ray_start_cluster.run_actors(), 30, "the notebook run's actors to go away")


def test_interrupting_the_kernel_stops_fit_and_frees_the_run(ray_start_cluster):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    connect = next(c.source for c in nb.cells if c.cell_type == "code" and "ray.init" in c.source)
    km, kc = start_new_kernel(
        kernel_name="python3", cwd=str(NOTEBOOK.parent), env=kernel_env(ray_start_cluster), startup_timeout=60
    )
    try:
        reply = kc.execute_interactive(connect, timeout=60, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        msg_id = kc.execute(
            "trainer = elastic.ElasticTrainer(train_fn, min_workers=2, max_workers=2, config={'epochs': 10_000})\n"
            "result = trainer.fit()"
        )
        wait_for_output(kc, msg_id, "[ray-elastic] started with", timeout=120)
        alive = ray_start_cluster.run_actors()
        # the driver, the KV store and at least min_workers workers
        assert len(alive) >= 4, alive
        assert ray_start_cluster.run_placement_groups(), "a training run holds placement groups"

        km.interrupt_kernel()
        reply = shell_reply(kc, msg_id, timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]

        wait_until(lambda: not ray_start_cluster.run_actors(), 30, "the interrupted run's actors to go away")
        wait_until(
            lambda: not ray_start_cluster.run_placement_groups(), 30, "the interrupted run's placement groups to go"
        )
        dead = {a["actor_id"] for a in ray_start_cluster.run_actors("DEAD")}
        assert {a["actor_id"] for a in alive} <= dead
        # the kernel and its connection to the cluster survive the interrupt: the next cell runs
        printed: list[str] = []
        reply = kc.execute_interactive(
            "print(ray.cluster_resources()['CPU'])",
            timeout=30,
            output_hook=lambda msg: printed.append(msg["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok" and "3.0" in "".join(printed), printed
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def wait_for_output(kc, msg_id: str, text: str, timeout: float) -> None:
    """Read the kernel's output of one execution until `text` appears; fail after `timeout` s."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            seen.append(msg["content"]["text"])
            if text in "".join(seen):
                return
        elif msg["msg_type"] == "error":
            raise AssertionError(f"the cell failed: {msg['content']['ename']}: {msg['content']['evalue']}")
    raise AssertionError(f"timed out after {timeout:g} s waiting for {text!r} in the cell's output: {''.join(seen)}")


def shell_reply(kc, msg_id: str, timeout: float) -> dict:
    """The execute_reply to `msg_id`; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_shell_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg
    raise AssertionError(f"timed out after {timeout:g} s waiting for the interrupted cell's reply")
