"""One report's checkpoint files across ranks: who owns which file, who keeps a replica, who sends what (pure).

Every rank may pass `report(checkpoint=...)` a directory of its own: with
FSDP2 and `torch.distributed.checkpoint` each rank writes `__<rank>_0.distcp`
and rank 0 also `.metadata`. Ray Train v2 uploads every rank's directory
into one storage directory, so the files combine into one checkpoint:

- A relative name passed by several ranks is kept once, from the lowest
  such rank, its *owner*. Identical contents are the usual case (every rank
  saved the same DDP model). Differing contents are a conflict: the lowest
  rank's copy is kept (the rule before sharded reports, where the lowest
  rank's files were the checkpoint) and the caller warns, naming the file
  and the ranks; Ray Train would keep whichever upload landed last.
- The files one rank owns are its *part*. A report of one part (only rank 0
  passed a checkpoint, or every rank passed the same files) is kept whole by
  every rank, as a DDP checkpoint always was: a recovery moves nothing to
  survivors. A report of several parts is kept by each owner and by one
  replica holder (`replica_ranks`), on another node where the run has
  several, so one node's loss loses no part.

A report's `Layout` (plain lists and dicts, so a durable copy of the state
stays plain) is what the run commits; the parts' bytes live outside the
committed state (`report_store.py`). Nothing here talks to Ray or the ring.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from collections.abc import Sequence

Files = dict[str, bytes]  # a checkpoint's files by path relative to its directory
Manifest = dict[str, tuple[int, str]]  # relative path -> (size, sha256 hex)
Entry = list[Any]  # [relative path, size, sha256 hex]


class Part(TypedDict):
    owner: int  # the rank that owned these files at the report (the part's key)
    files: list[Entry]  # in path order: a part's bytes are its files' bytes in this order


class Layout(TypedDict):
    index: int  # how many checkpoints were reported, this one included (0: resume_from_checkpoint's)
    parts: list[Part]  # by owner rank
    directory: str | None  # its durable directory's name under Result.path (None: none was written)


def manifest(files: Files) -> Manifest:
    """Size and SHA-256 of each file."""
    return {name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()}


def combine(manifests: Sequence[Manifest | None]) -> tuple[list[Part], list[tuple[str, list[int]]]]:
    """The parts of a report whose ranks passed these files (None: no checkpoint), and the conflicts.

    A conflict is `(path, ranks)`: the ranks that passed `path` with differing
    contents; the lowest one's copy is the one in the parts.
    """
    owned: dict[int, list[Entry]] = {}
    first: dict[str, tuple[int, str]] = {}  # path -> (owner, digest)
    clashes: dict[str, list[int]] = {}
    for rank, files in enumerate(manifests):
        for name in sorted(files or {}):
            size, digest = (files or {})[name]
            if name not in first:
                first[name] = (rank, digest)
                owned.setdefault(rank, []).append([name, size, digest])
            elif first[name][1] != digest:
                clashes.setdefault(name, [first[name][0]]).append(rank)
    parts = [Part(owner=rank, files=owned[rank]) for rank in sorted(owned)]
    return parts, sorted(clashes.items())


def kept_whole(layout: Layout) -> bool:
    """Whether every rank keeps the whole report (one part), rather than owners and replicas."""
    return len(layout["parts"]) <= 1


def replica_ranks(hosts: Sequence[str]) -> list[int]:
    """For each rank, the rank that keeps a replica of its part (its own rank at world 1).

    Ranks are contiguous per host. Rank r's replica goes one host's width
    further round the ring (r + the size of r's host): on hosts of equal
    size that is the same local rank on the next host, so every rank keeps
    exactly one replica. Where that rank is on r's own host (hosts of
    unequal size), the replica goes to the next rank round the ring on
    another host. On one host it is simply the next rank.
    """
    size = len(hosts)
    if size <= 1:
        return list(range(size))
    if len(set(hosts)) == 1:
        return [(r + 1) % size for r in range(size)]
    width = {h: hosts.count(h) for h in hosts}
    replicas = []
    for r, host in enumerate(hosts):
        candidate = (r + width[host]) % size
        while hosts[candidate] == host:
            candidate = (candidate + 1) % size
        replicas.append(candidate)
    return replicas


def keepers(layout: Layout, hosts: Sequence[str]) -> list[set[int]]:
    """After a re-entry, which ranks of the new world keep each part (in `layout["parts"]` order).

    A whole-kept report stays with every rank. Otherwise part i goes to rank
    i mod size, and its replica to the rank on another host (any other rank
    on one host) that keeps the fewest bytes so far, the nearest round the
    ring first: the bytes each rank keeps stay near two parts' worth.
    """
    size = len(hosts)
    if kept_whole(layout):
        return [set(range(size)) for _ in layout["parts"]]
    load = [0] * size
    out = []
    for i, part in enumerate(layout["parts"]):
        keeper = i % size
        load[keeper] += part_size(part)
        others = [r for r in range(size) if hosts[r] != hosts[keeper]] or [r for r in range(size) if r != keeper]
        if not others:
            out.append({keeper})
            continue
        replica = min(others, key=lambda r: (load[r], (r - keeper) % size))
        load[replica] += part_size(part)
        out.append({keeper, replica})
    return out


def sources(layout: Layout, held: Sequence[Sequence[int]]) -> list[int | None]:
    """For each part, the live rank that sends it (the lowest holder), or None where no rank holds it.

    `held[r]` are the owner keys of the parts rank r holds in memory.
    """
    out: list[int | None] = []
    for part in layout["parts"]:
        holders = [r for r, keys in enumerate(held) if part["owner"] in keys]
        out.append(holders[0] if holders else None)
    return out


def part_size(part: Part) -> int:
    return sum(int(size) for _, size, _ in part["files"])


def pack(files: Files, part: Part) -> bytearray:
    """A part's files as one buffer, in the part's order (what goes over the ring)."""
    blob = bytearray()
    for name, _, _ in part["files"]:
        blob += files[name]
    return blob


def unpack(blob: bytes | bytearray | memoryview, part: Part) -> Files:
    """A part's files from its buffer; `ValueError` if the sizes or digests do not match the layout."""
    view = memoryview(blob)
    if len(view) != part_size(part):
        raise ValueError(f"rank {part['owner']}'s checkpoint files: {len(view)} bytes, expected {part_size(part)}")
    files: Files = {}
    at = 0
    for name, size, digest in part["files"]:
        data = bytes(view[at : at + int(size)])
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"checkpoint file {name!r} of rank {part['owner']} arrived with other contents")
        files[name] = data
        at += int(size)
    return files
