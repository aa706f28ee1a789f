"""This worker's share of the reported checkpoints' files: kept in memory, moved over the ring, written durably.

`report_files.py` decides who owns and who keeps what; this module does it
on the current generation's ring (`CollectiveGroup`), for `session.Session`:

- `report` (every rank, at a `report()` with a checkpoint on any rank):
  one `allgather_object` of each rank's manifest and host; a report kept
  whole goes from its owner to every rank (`broadcast_object`); a report of
  several parts goes from each owner to its replica holder, point to point
  (`send_async`/`recv_async` of one byte tensor per part, sizes known from
  the manifests). Each owner also writes its files into the run's staging
  directory; once every rank is through (a barrier), rank 0 renames it to
  the durable directory under `Result.path`, so that directory only ever
  appears with every rank's files.
- `committed` (every rank, once the report is committed): a barrier, after
  which no rank can roll back to an older report: the older reports' files
  are dropped. Between reports a rank holds its own part and one replica.
- `settle` (every rank, at each entry into the loop after a reset): the
  report the run rolled back to is gathered from its live holders, owner
  or replica, or, where neither lives, read from its durable directory;
  every rank writes all of it to a local directory for `get_checkpoint()`,
  then keeps its new share only (`report_files.keepers`). Survivors of a
  report every rank keeps whole move nothing.

Every collective is the ring's (bounded by `collective_timeout`; a dead
peer raises `HorovodInternalError`, which the run loop handles).

Beside the durable directories, `Result.path/reported_checkpoints.json`
(`write_index`, by rank 0 after each committed report, and by `fit()` at
the end) lists the durable checkpoints kept, oldest first, each with rank
0's metrics of its report: what `Result.from_path` reads back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import TYPE_CHECKING, Any

import torch

import ray_elastic as elastic
from ray_elastic.train.report_files import (
    Files,
    Layout,
    Part,
    combine,
    keepers,
    kept_whole,
    manifest,
    pack,
    part_size,
    replica_ranks,
    sources,
    unpack,
)

if TYPE_CHECKING:
    from ray_elastic.collective.base import CollectiveGroup

logger = logging.getLogger(__name__)


def write_files(files: Files, directory: str) -> None:
    """Write a checkpoint's files under `directory` (made if missing)."""
    os.makedirs(directory, exist_ok=True)
    for relative, data in files.items():
        path = os.path.join(directory, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


INDEX_FILE = "reported_checkpoints.json"
_INDEX_FORMAT = 1


def write_index(run_path: str, durable: list[list[Any]]) -> None:
    """Write `run_path/reported_checkpoints.json`: `[directory name, metrics]` of each durable checkpoint kept.

    Replaced whole (a temporary file renamed over it), so a reader finds the
    old list or the new one. A metric JSON cannot hold is written as its
    `tolist()` (numpy values, tensors) or else its `str()`.
    """
    entries = [{"directory": name, "metrics": metrics} for name, metrics in durable]
    text = json.dumps({"format": _INDEX_FORMAT, "checkpoints": entries}, default=_plain)
    final = os.path.join(run_path, INDEX_FILE)
    partial = f"{final}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, final)


def parse_index(text: str) -> list[tuple[str, dict[str, Any]]]:
    """`(directory name, metrics)` of each checkpoint a `reported_checkpoints.json` lists, oldest first."""
    index = json.loads(text)
    if not isinstance(index, dict) or index.get("format") != _INDEX_FORMAT:
        raise ValueError(f"not a ray_elastic {INDEX_FILE} of format {_INDEX_FORMAT}")
    return [(entry["directory"], dict(entry["metrics"])) for entry in index["checkpoints"]]


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


def staging_name(directory: str, generation: int) -> str:
    """Where a report's durable files gather before rank 0 renames them (the generation keeps torn tries apart)."""
    return f".{directory}.g{generation}.partial"


class ReportStore:
    """The reported checkpoints' files this worker holds, by (report index, owner rank at the report).

    Args:
        run_path: `storage_path/name`, where durable checkpoint directories
            go (None: nothing is written durably).
    """

    def __init__(self, run_path: str | None) -> None:
        self.run_path = run_path
        self.parts: dict[tuple[int, int], Files] = {}

    def hold_whole(self, index: int, files: Files) -> Layout:
        """Hold `files` as report `index` kept whole by every rank (`resume_from_checkpoint`'s, on every worker)."""
        layout = Layout(index=index, parts=[], directory=None)
        if files:
            (part,), _ = combine([manifest(files)])
            layout["parts"].append(part)
            self.parts[(index, 0)] = files
        return layout

    def held_bytes(self) -> int:
        return sum(len(data) for files in self.parts.values() for data in files.values())

    # ---- a report -----------------------------------------------------------------------
    def report(
        self, ring: CollectiveGroup, files: Files | None, index: int, host: str, directory: str, generation: int
    ) -> Layout:
        """Combine every rank's `files` into report `index`, keep this rank's share, stage the durable copy.

        Returns the layout every rank computes alike, with `directory` set
        where a durable copy was written.
        """
        rank = ring.rank
        gathered = ring.allgather_object((manifest(files) if files is not None else None, host))
        parts, conflicts = combine([m for m, _ in gathered])
        if conflicts and rank == 0:
            for name, ranks in conflicts:
                logger.warning(
                    "report(checkpoint=...): ranks %s passed %r with different contents; rank %d's copy is kept "
                    "(give each rank's file its own name, or pass it from one rank)",
                    ranks,
                    name,
                    ranks[0],
                )
        layout = Layout(index=index, parts=parts, directory=None)
        mine = next((p for p in parts if p["owner"] == rank), None)
        if not parts:
            pass  # only empty directories were passed
        elif kept_whole(layout):
            part = parts[0]
            blob = ring.broadcast_object(pack(files or {}, part) if rank == part["owner"] else None, part["owner"])
            self.parts[(index, part["owner"])] = _own(files, part) if rank == part["owner"] else unpack(blob, part)
        else:
            self._replicate(ring, files, layout, replica_ranks([h for _, h in gathered]))
        if self.run_path is not None:
            staging = os.path.join(self.run_path, staging_name(directory, generation))
            if mine is not None:
                write_files(_own(files, mine), staging)
            ring.barrier()  # every owner's files are staged, and every replica is held
            if rank == 0:
                final = os.path.join(self.run_path, directory)
                os.makedirs(staging, exist_ok=True)
                shutil.rmtree(final, ignore_errors=True)  # a torn earlier try, or a name reported again
                os.rename(staging, final)
                self._drop_torn_staging(directory)
            layout["directory"] = directory
        else:
            ring.barrier()
        return layout

    def _drop_torn_staging(self, directory: str) -> None:
        """Remove the staging directories of `directory` that earlier generations' torn tries left.

        A report cut by a failure leaves its staging directory; the rollback
        reports the same name again (its index comes from the commit), so
        the next rename of that name is where the torn ones are known dead.
        """
        assert self.run_path is not None
        torn = re.compile(rf"\.{re.escape(directory)}\.g\d+\.partial")  # staging_name's, of any generation
        for name in os.listdir(self.run_path):
            if torn.fullmatch(name):
                shutil.rmtree(os.path.join(self.run_path, name), ignore_errors=True)

    def _replicate(self, ring: CollectiveGroup, files: Files | None, layout: Layout, replicas: list[int]) -> None:
        """Each owner sends its part to its replica holder; every rank keeps its own part and those it received."""
        rank, index = ring.rank, layout["index"]
        works, incoming = [], []
        for part in layout["parts"]:
            owner, size = part["owner"], part_size(part)
            if owner == rank:
                self.parts[(index, owner)] = _own(files, part)
                if size:
                    blob = torch.frombuffer(pack(files or {}, part), dtype=torch.uint8)
                    works.append(ring.send_async(blob, replicas[owner]))
            elif replicas[owner] == rank:
                buffer = torch.empty(size, dtype=torch.uint8)
                incoming.append((part, buffer))
                if size:
                    works.append(ring.recv_async(buffer, owner))
        for work in works:
            work.wait()
        for part, buffer in incoming:
            self.parts[(index, part["owner"])] = unpack(buffer.numpy(), part)

    def committed(self, ring: CollectiveGroup, index: int, dropped_directories: list[str]) -> None:
        """Once every rank committed report `index`: drop older reports' files, and (rank 0) pruned directories."""
        ring.barrier()  # past it, every rank committed `index`: no rollback to an older report remains possible
        self.keep_only(index)
        if ring.rank == 0 and self.run_path is not None:
            for name in dropped_directories:
                shutil.rmtree(os.path.join(self.run_path, name), ignore_errors=True)

    def keep_only(self, index: int | None) -> None:
        self.parts = {key: files for key, files in self.parts.items() if key[0] == index}

    # ---- after a reset ----------------------------------------------------------------------
    def local_files(self, layout: Layout) -> Files | None:
        """All of the report's files, if this rank holds every part; else None."""
        files: Files = {}
        for part in layout["parts"]:
            held = self.parts.get((layout["index"], part["owner"]))
            if held is None:
                return None
            files.update(held)
        return files

    def settle(self, ring: CollectiveGroup, layout: Layout | None, host: str) -> Files | None:
        """Gather report `layout` from its live holders onto every rank; keep this rank's new share.

        Returns every file of the report where any moved (the caller writes
        them out for `get_checkpoint()`), None where every rank already held
        every part (nothing moved) or there is no report.
        """
        self.keep_only(None if layout is None else layout["index"])
        if layout is None:
            return None
        index = layout["index"]
        held = sorted(owner for i, owner in self.parts if i == index)
        gathered = ring.allgather_object((held, host))
        owners = {p["owner"] for p in layout["parts"]}
        if all(owners <= set(keys) for keys, _ in gathered):
            return None
        everything: Files = {}
        new_share: dict[tuple[int, int], Files] = {}
        stay = keepers(layout, [h for _, h in gathered])
        for part, source, keep in zip(layout["parts"], sources(layout, [k for k, _ in gathered]), stay, strict=True):
            key = (index, part["owner"])
            if source is None:
                files = self._read_durable(layout, part)
            else:
                blob = ring.broadcast_object(pack(self.parts[key], part) if ring.rank == source else None, source)
                files = self.parts[key] if key in self.parts else unpack(blob, part)
            everything.update(files)
            if ring.rank in keep:
                new_share[key] = files
        self.parts = new_share
        if ring.rank == 0 and self.run_path is not None and layout["directory"] is not None:
            final = os.path.join(self.run_path, layout["directory"])
            if not os.path.isdir(final):  # rank 0 died between the report's barrier and its rename
                write_files(everything, final)
        return everything

    def _read_durable(self, layout: Layout, part: Part) -> Files:
        """A part no live worker holds (its owner and its replica are both gone), from the durable directory."""
        where = os.path.join(self.run_path or "", layout["directory"] or "")
        files: Files = {}
        try:
            for name, _, _ in part["files"]:
                with open(os.path.join(where, name), "rb") as f:
                    files[name] = f.read()
        except OSError as e:
            raise elastic.CheckpointError(
                f"checkpoint {layout['index']} is lost: no live worker holds rank {part['owner']}'s files of it "
                f"(its owner and its replica both left) and its durable copy cannot be read: {e}"
            ) from e
        logger.warning("rank %s's files of checkpoint %d read from %s", part["owner"], layout["index"], where)
        return unpack(b"".join(files[name] for name, _, _ in part["files"]), part)


def _own(files: Files | None, part: Part) -> Files:
    held = files or {}
    return {name: held[name] for name, _, _ in part["files"]}
