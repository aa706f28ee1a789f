"""Where a benchmark's figures go: `bench/results/<name>.json`, with when and where."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def write_results(name: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    """Save `rows` with the date, the machine and `meta`; return the path."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the pygloo lane's venv has no torch
        torch_version = None
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch_version,
        **meta,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return out
