"""What `fit()` shows while it trains: a progress bar and one line per event.

The bar (tqdm: a text bar in a terminal, a widget in a notebook, as
`tqdm.auto` would pick) shows the driver's state, the epoch and step, the
world size, the resets and rank 0's latest metrics (epoch and step come from
the reported `epoch` and `step` keys; without a `step` key the bar counts
reports). Membership events become one log line each as they complete, e.g.
"worker w3 (rank 2) on node ab12cd34 died; recovered in 0.06 s, world size 4 -> 3".
Where output is not a terminal the bar is off and the lines go to the
`ray_elastic` logger. `verbose=0` hides both.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("ray_elastic")

# kinds that paused no training (nobody waited): their detail alone, as it happens, with no "recovered in"
_NO_PAUSE = (
    *("newcomer_failed", "resumed", "straggler_found", "kv_restarted", "driver_restarted"),
    *("backend_changed", "data_slow", "snapshot_refused"),
)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._logged: set[tuple[float, str, str]] = set()
        self._reports = 0
        self._latest: dict[str, Any] = {}
        if enabled:
            tqdm, disable = _bar_class()
            self._bar = tqdm(total=None, unit="step", desc="ray-elastic", dynamic_ncols=True, disable=disable)
            if self._bar.disable:
                _ensure_log_handler()

    def update(self, status: dict[str, Any]) -> None:
        if not self.enabled:
            return
        for ev in status.get("events", []):
            key = (ev["time"], ev["kind"], ev["detail"])
            if key in self._logged or (ev["reset_duration"] is None and status.get("state") not in ("done", "failed")):
                continue
            self._logged.add(key)
            self._write(describe(ev))
        metrics = status.get("metrics", [])
        if metrics:
            self._reports += len(metrics)
            self._latest = metrics[-1][1]
        if self._bar is None or self._bar.disable:
            return
        if metrics:
            self._bar.update(len(metrics))
            shown = {k: v for k, v in self._latest.items() if k not in ("epoch", "step")}
            self._bar.set_postfix_str(" ".join(f"{k}={_short(v)}" for k, v in list(shown.items())[:6]), refresh=False)
        epoch = f"epoch {self._latest['epoch']} " if "epoch" in self._latest else ""
        step = self._latest.get("step", self._reports)
        spares = f" +{status['spares']} spare" if status.get("spares") else ""
        self._bar.set_description(
            f"ray-elastic [{status.get('state', '?')}] {epoch}step {step} world {status.get('world_size', 0)}{spares} "
            f"resets {status.get('resets', 0)}",
            refresh=True,
        )

    def note(self, line: str) -> None:
        """A line about the whole run (the CPUs kept for Ray Data): shown as an event's is, logged if silenced."""
        if self.enabled:
            self._write(line)
        else:
            logger.info(line)

    def _write(self, line: str) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            logger.info(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _bar_class() -> tuple[Any, bool | None]:
    """The tqdm class and its `disable` argument for where we run.

    In a notebook the kernel's streams are no terminal, yet a bar renders:
    a widget where ipywidgets is installed, else a text line Jupyter redraws.
    Elsewhere `disable=None` leaves no bar where output is not a terminal
    (a job's log, CI), where the event lines still print.
    """
    if _in_notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm
        except ImportError:
            from tqdm.std import tqdm
        return tqdm, False
    from tqdm.std import tqdm

    return tqdm, None


def _ensure_log_handler() -> None:
    """Event lines reach a job's log even when the user configured no logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


def describe(ev: dict[str, Any]) -> str:
    """One line for an event, e.g. "worker w3 ... died; recovered in 0.06 s, world size 4 -> 3"."""
    if ev["kind"] == "start":
        took = f" in {ev['reset_duration']:.1f} s" if ev["reset_duration"] is not None else ""
        return f"[ray-elastic] started with {ev['world_size']} workers{took}"
    sizes = f"world size {ev.get('previous_world_size')} -> {ev['world_size']}"
    if ev["kind"] in _NO_PAUSE:
        return f"[ray-elastic] {ev['detail']}"
    if ev["reset_duration"] is None:
        return f"[ray-elastic] {ev['detail']}; {sizes}"
    verb = "recovered" if ev["kind"] in ("worker_failed", "reset_requested", "restarted") else "resized"
    verb = "joined" if ev["kind"] == "spare_promoted" else verb
    return f"[ray-elastic] {ev['detail']}; {verb} in {ev['reset_duration']:.2f} s, {sizes}"
