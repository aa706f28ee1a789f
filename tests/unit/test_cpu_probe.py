"""`cpu_probe.sample_cpu` on real processes: the state the judge reads is the process's, not its main thread's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ray_elastic.driver.shell.cpu_probe import sample_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_process_whose_main_thread_sleeps_while_another_thread_runs_reads_runnable_not_sleeping():
    """A starved process shows its main thread asleep on a lock its own runnable thread is to serve: the judge
    must see it waiting for the machine (R), not hung (S)."""
    proc = spawn(
        """
        import threading
        def spin():
            while True:
                pass
        threading.Thread(target=spin, daemon=True).start()
        print("ready", flush=True)
        threading.Event().wait()
        """
    )
    try:
        sample = sample_cpu([proc.pid], 0.3)[proc.pid]
        assert not isinstance(sample, str), sample
        assert sample.state == "R", sample
    finally:
        proc.kill()
        proc.wait()


def test_a_process_whose_every_thread_sleeps_reads_sleeping():
    proc = spawn(
        """
        import threading
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        print("ready", flush=True)
        threading.Event().wait()
        """
    )
    try:
        sample = sample_cpu([proc.pid], 0.3)[proc.pid]
        assert not isinstance(sample, str), sample
        assert sample.state == "S" and sample.busiest_thread_s < 0.05, sample
    finally:
        proc.kill()
        proc.wait()


def test_a_thread_runnable_at_one_reading_only_is_no_evidence_of_waiting_for_the_machine():
    """A hung process's I/O thread serving the ping it misses is runnable for an instant: the judge must read the
    process as sleeping (hung), not as waiting for a CPU (spared). One runnable at both readings is starved."""
    from ray_elastic.driver.shell.cpu_probe import _state

    sleeping = {"100": ("S", 50), "101": ("S", 7)}
    blip = {"100": ("S", 50), "101": ("R", 7)}
    assert _state(100, sleeping, blip) == "S"
    assert _state(100, blip, sleeping) == "S"
    assert _state(100, blip, blip) == "R"
    assert _state(100, {"100": ("S", 50), "101": ("D", 7)}, {"100": ("S", 50), "101": ("D", 7)}) == "D"
    assert _state(100, {"100": ("T", 50)}, {"100": ("T", 50), "102": ("R", 0)}) == "T"  # a thread born in between
