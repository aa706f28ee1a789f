"""Where a benchmark's figures go: `bench/results/<name>.json`, with when and where."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any


def _version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None where this venv lacks it (the pygloo lane's has no torch)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def write_results(name: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    """Save `rows` with the date, the machine, the versions that made them and `meta`; return the path."""
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": _version("ray"),
        "torch": _version("torch"),
        **meta,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return out
