"""`Result.plot_timeline`: world size and throughput over time, with the events marked.

Two panels share the time axis (seconds since the run started): the world
size as a step line, and rank 0's steps per second (its `report()` calls,
one per step, counted in equal bins). Every membership event is a vertical
line coloured by its kind. Built on matplotlib's object API (no pyplot), so
it works in scripts, jobs and notebooks without touching the user's backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

    from ray_elastic.events import Event

_COLORS = {
    "worker_failed": "tab:red",
    "newcomer_failed": "tab:orange",
    "hosts_added": "tab:green",
    "hosts_removed": "tab:purple",
    "reset_requested": "tab:brown",
    "restarted": "black",
    "resumed": "tab:blue",
}


def world_size_steps(events: Sequence[Event], end: float) -> tuple[list[float], list[int]]:
    """(times, sizes) of the world size as a step function from the start of training to `end`."""
    ordered = sorted((e for e in events if e.reset_duration is not None or e.kind == "start"), key=lambda e: e.time)
    times, sizes = [], []
    for e in ordered:
        if e.kind in ("resumed", "newcomer_failed"):
            continue  # no change of membership
        # the first generation trains once its workers booted and synced, not when the run began
        times.append(e.time + e.reset_duration if e.kind == "start" and e.reset_duration else e.time)
        sizes.append(e.world_size)
    if times:
        times.append(max(end, times[-1]))
        sizes.append(sizes[-1])
    return times, sizes


def throughput(times: Sequence[float], bins: int = 60) -> tuple[list[float], list[float]]:
    """(bin centres, reports per second) over `times`, in `bins` equal bins."""
    if len(times) < 2:
        return [], []
    start, end = min(times), max(times)
    width = max((end - start) / bins, 1e-3)
    counts = [0] * bins
    for t in times:
        counts[min(int((t - start) / width), bins - 1)] += 1
    return [start + (i + 0.5) * width for i in range(bins)], [c / width for c in counts]


def plot_timeline(events: Sequence[Event], metric_times: Sequence[float], path: str | os.PathLike) -> Path:
    """Save the timeline PNG to `path` and return it."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise ImportError(
            "plot_timeline needs matplotlib: pip install matplotlib (the 'plot' extra of ray-elastic)"
        ) from e
    stamps = [e.time for e in events] + list(metric_times)
    if not stamps:
        raise ValueError("nothing to plot: the result has no events and no reported metrics")
    t0 = min(stamps)
    end = max(stamps)
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    size_ax, rate_ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.4])
    times, sizes = world_size_steps(events, end)
    if times:
        size_ax.step([t - t0 for t in times], sizes, where="post", color="tab:blue", linewidth=2)
        size_ax.set_ylim(0, max(sizes) + 1)
    size_ax.set_ylabel("world size")
    size_ax.yaxis.get_major_locator().set_params(integer=True)
    centres, rates = throughput(metric_times)
    rate_ax.plot([c - t0 for c in centres], rates, color="tab:gray", linewidth=1.5)
    rate_ax.set_ylabel("steps / s (rank 0's reports)")
    rate_ax.set_xlabel("seconds since the run started")
    kinds_seen = []
    for ev in events:
        if ev.kind == "start":
            continue
        color = _COLORS.get(ev.kind, "tab:cyan")
        for ax in (size_ax, rate_ax):
            ax.axvline(ev.time - t0, color=color, linestyle="--", linewidth=1, alpha=0.8)
        if ev.kind not in kinds_seen:
            kinds_seen.append(ev.kind)
    if kinds_seen:
        handles = [Line2D([], [], color=_COLORS.get(k, "tab:cyan"), linestyle="--", label=k) for k in kinds_seen]
        size_ax.legend(handles=handles, loc="lower left", fontsize="small", ncols=min(len(handles), 4))
    recoveries = [e.reset_duration for e in events if e.kind == "worker_failed" and e.reset_duration is not None]
    title = f"ray-elastic run: {len(events)} events"
    if recoveries:
        title += f", worst recovery {max(recoveries):.2f} s"
    size_ax.set_title(title)
    for ax in (size_ax, rate_ax):
        ax.grid(True, alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
