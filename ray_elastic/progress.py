"""What `fit()` shows while it trains: a progress bar and one line per event.

The bar (`tqdm.auto`, so it renders in a terminal and in a notebook) shows
the driver's state, the world size, the resets and rank 0's latest metrics.
Membership events become log lines as they complete. `verbose=0` hides both.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ray_elastic")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._logged: set[tuple[float, str]] = set()
        self._steps = 0
        if enabled:
            from tqdm.auto import tqdm

            # disable=None: no bar where output is not a terminal (logs), event lines still print
            self._bar = tqdm(total=None, unit="step", desc="ray-elastic", dynamic_ncols=True, disable=None)

    def update(self, status: dict[str, Any]) -> None:
        if not self.enabled:
            return
        for ev in status.get("events", []):
            key = (ev["time"], ev["kind"])
            if key in self._logged or (ev["reset_duration"] is None and status.get("state") not in ("done", "failed")):
                continue
            self._logged.add(key)
            line = _describe(ev)
            if self._bar is not None:
                self._bar.write(line)
            else:
                logger.info(line)
        metrics = status.get("metrics", [])
        if self._bar is not None:
            if metrics:
                self._bar.update(len(metrics))
                latest = metrics[-1][1]
                self._bar.set_postfix_str(
                    " ".join(f"{k}={_short(v)}" for k, v in list(latest.items())[:6]), refresh=False
                )
            self._bar.set_description(
                f"ray-elastic [{status.get('state', '?')}] world={status.get('world_size', 0)} "
                f"resets={status.get('resets', 0)}",
                refresh=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_VERBS = {"start": "ready", "worker_failed": "recovered", "reset_requested": "recovered"}


def _describe(ev: dict[str, Any]) -> str:
    took = ""
    if ev["reset_duration"] is not None:
        took = f"; {_VERBS.get(ev['kind'], 'resized')} in {ev['reset_duration']:.2f} s"
    if ev["kind"] == "start":
        return f"[ray-elastic] started with {ev['world_size']} workers{took}"
    return f"[ray-elastic] {ev['detail']}{took}, world size now {ev['world_size']}"
