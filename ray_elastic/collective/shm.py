"""Allreduce through shared memory, for a generation whose ranks all run on one machine.

Gloo moves every byte of an allreduce through the kernel's TCP loopback,
twice per hop of its ring, and wakes each rank once per hop. Ranks on one
machine can instead meet in one shared segment: each writes its tensor into
its own slot, waits for the others (a barrier), sums one slice of every
slot into a result area (rank r sums slice r, in rank order), waits again,
and copies the whole result back: several times faster than Gloo's TCP
loopback for the same sum (`bench/shm_allreduce.py` measures it). Every rank copies the same result, so
the ranks stay bitwise equal; the sum's order is rank order, where Gloo's
ring adds in ring order (the two agree bitwise at world 2, and differ by
rounding from world 3 up).

`SharedRing.build(group)` sets one up over a torch Gloo group, once per
generation, or returns None when the ranks do not share one machine and one
`/dev/shm` (compared by boot id and the device of `/dev/shm`, then checked
by every rank opening the segment), when `/dev/shm` has no room for it, or
when `RAY_ELASTIC_SHM_ALLREDUCE=0`; callers then keep Gloo. The segment is
`size + 1` slots of at most `SLOT_BYTES` (larger tensors go through in
pieces), reserved with `posix_fallocate` so a full `/dev/shm` fails here
and not as a SIGBUS mid-step. It is unlinked as soon as every rank has
mapped it, so nothing is left behind, whatever happens to the processes.

The barriers are one byte to every peer over Unix stream sockets (a full
mesh, connected at build, their files likewise unlinked at once). A peer
that dies closes its sockets, so the survivors' wait fails at once with
`HorovodInternalError`; the driver's abandon of the generation ends a wait
within `POLL_S`; anything else is bounded by the group's
`collective_timeout`.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
import uuid
from typing import Any

import numpy as np
import torch

from ray_elastic.collective.base import Min
from ray_elastic.exceptions import HorovodInternalError

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 * 2**20  # one slot's bytes: a tensor larger than this goes through in pieces
MAX_SEGMENT_BYTES = 64 * 2**20  # the whole segment's bound (Docker's default /dev/shm is 64 MB)
POLL_S = 0.05  # how often a barrier's wait looks at the driver's abandon
SHM_DIR = "/dev/shm"
ENV_SWITCH = "RAY_ELASTIC_SHM_ALLREDUCE"


def machine_key() -> str:
    """Which machine and which `/dev/shm` this process sees: equal keys can share a segment."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return f"unshared-{uuid.uuid4()}"
    return f"{boot}/{dev}"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def slot_bytes_for(size: int) -> int:
    """Each slot's bytes at world `size`: `SLOT_BYTES`, less where `size + 1` of those exceed the segment's bound."""
    per = min(SLOT_BYTES, MAX_SEGMENT_BYTES // (size + 1))
    return max(4096, per - per % 4096)


def can_reduce(tensors: list[torch.Tensor], sum_op: bool) -> bool:
    """Whether a torch allreduce of `tensors` is one this ring does: a sum of one contiguous CPU tensor."""
    if not sum_op or len(tensors) != 1:
        return False
    t = tensors[0]
    return t.device.type == "cpu" and t.is_contiguous() and t.dtype != torch.bool and not t.is_complex()


class SharedRing:
    """One generation's shared segment and barrier sockets (see the module docstring)."""

    def __init__(
        self, group: Any, segment: mmap.mmap, slot_bytes: int, peers: dict[int, socket.socket], timeout_s: float
    ) -> None:
        self._group = group
        self.rank = group.rank
        self.size = group.size
        self._segment = segment
        self._memory = torch.frombuffer(segment, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        self._peers = sorted(peers.items())
        self._timeout_s = timeout_s
        self._broken: str | None = None
        self._slots: dict[torch.dtype, list[torch.Tensor]] = {}  # each slot viewed as a dtype, made once

    def _slots_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The `size` ranks' slots and the result area, as `dtype` elements."""
        slots = self._slots.get(dtype)
        if slots is None:
            b = self.slot_bytes
            slots = self._slots[dtype] = [self._memory[r * b : (r + 1) * b].view(dtype) for r in range(self.size + 1)]
        return slots

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def build(cls, group: Any, timeout_s: float) -> SharedRing | None:
        """A shared ring over `group`'s ranks (every rank calls it, in the same place), or None: keep Gloo.

        Costs three small collectives of the group (an `allgather_object`
        and one allreduce) and, where the machine is shared, the segment's
        creation and N(N-1)/2 socket connections.
        """
        if group.size < 2 or not enabled():
            return None
        slot = slot_bytes_for(group.size)
        path = sock_path = None
        listener = segment = None
        peers: dict[int, socket.socket] = {}
        ok = False
        try:
            try:
                listener, sock_path = _listen(group.size)
            except OSError as e:
                logger.info("no shared-memory allreduce: rank %d cannot listen in %s: %s", group.rank, SHM_DIR, e)
            if group.rank == 0:
                path = _create_segment(slot * (group.size + 1))
            hellos = group.allgather_object((machine_key(), sock_path, path))
            if len({h[0] for h in hellos}) == 1 and all(h[1] for h in hellos) and hellos[0][2]:
                try:
                    segment = _map(hellos[0][2], slot * (group.size + 1))
                    # a dial into a listening Unix socket returns at once, accepted or not: nobody waits here
                    peers = _dial_lower(group.rank, [h[1] for h in hellos[: group.rank]], timeout_s)
                    ok = True
                except OSError as e:
                    logger.info("no shared-memory allreduce: rank %d could not join the segment: %s", group.rank, e)
            flags = np.array([int(ok)], dtype=np.int64)
            ok = bool(group.allreduce_(flags, Min)[0])  # every rank mapped and dialled, or nobody uses it
            if ok:
                assert listener is not None  # every rank gave a socket path, this one too: it listens
                peers.update(_accept_higher(listener, group.rank, group.size, timeout_s))  # queued already
        except OSError as e:  # a rank that said it was ready is gone
            ok = False
            raise HorovodInternalError(f"setting up the shared-memory allreduce failed: {e}") from e
        finally:
            if path is not None:
                os.unlink(path)  # every rank has mapped it (or gave up): the mapping outlives the name
            if sock_path is not None:
                os.unlink(sock_path)
            if listener is not None:
                listener.close()
            if not ok:
                for s in peers.values():
                    s.close()
                if segment is not None:
                    segment.close()
        if not ok:
            return None
        assert segment is not None  # every rank mapped it, this one too
        for s in peers.values():
            s.settimeout(POLL_S)
        return cls(group, segment, slot, peers, timeout_s)

    # ---- the allreduce ---------------------------------------------------------------------
    def allreduce_sum_(self, t: torch.Tensor) -> None:
        """Sum `t` (contiguous, on CPU) over the ranks in place; `HorovodInternalError` on any failure."""
        if self._broken is not None:
            raise HorovodInternalError(f"shared-memory allreduce not started: {self._broken}")
        self._group.check_abandoned("shared-memory allreduce")
        flat = t.view(-1)
        per_piece = self.slot_bytes // t.element_size()
        slots = self._slots_as(t.dtype)
        mine, result = slots[self.rank], slots[self.size]
        try:
            with torch.no_grad():
                for start in range(0, flat.numel(), per_piece):
                    piece = flat[start : start + per_piece]
                    n = piece.numel()
                    mine[:n].copy_(piece)
                    self._barrier("every rank's gradients in shared memory")
                    lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size
                    if hi > lo:
                        out = result[lo:hi]
                        torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
                        for r in range(2, self.size):
                            out.add_(slots[r][lo:hi])
                    self._barrier("every rank's slice of the sum")
                    piece.copy_(result[:n])
        except HorovodInternalError as e:
            self._broken = str(e)
            raise

    def _barrier(self, what: str) -> None:
        """One byte to every peer, then one from every peer: a dead peer's closed socket fails it at once."""
        for r, s in self._peers:
            try:
                s.sendall(b"\x01")
            except OSError as e:
                raise HorovodInternalError(f"shared-memory allreduce: rank {r} is gone ({e})") from e
        deadline = time.monotonic() + self._timeout_s
        for r, s in self._peers:
            while True:
                try:
                    got = s.recv(1)
                except TimeoutError:
                    if self._group.abandoned is not None:
                        raise HorovodInternalError(f"shared-memory allreduce abandoned: {self._group.abandoned}")
                    if time.monotonic() > deadline:
                        raise HorovodInternalError(
                            f"shared-memory allreduce: waited {self._timeout_s:g} s (collective_timeout) for rank "
                            f"{r} to reach the barrier after {what}"
                        ) from None
                    continue
                except OSError as e:
                    raise HorovodInternalError(f"shared-memory allreduce: rank {r} is gone ({e})") from e
                if not got:
                    raise HorovodInternalError(f"shared-memory allreduce: rank {r} closed its link (it exited)")
                break

    def close(self) -> None:
        for _, s in self._peers:
            s.close()
        self._peers = []
        self._slots = {}
        self._memory = None
        try:
            self._segment.close()
        except BufferError:  # a tensor view still exported (a failed step's): the mapping goes with the process
            pass


def _listen(size: int) -> tuple[socket.socket, str]:
    """A listening Unix socket in /dev/shm (where the segment is, so reachable wherever the segment is)."""
    sock_path = os.path.join(SHM_DIR, f"ray-elastic-{uuid.uuid4().hex[:16]}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(size)
    return listener, sock_path


def _create_segment(nbytes: int) -> str | None:
    """A new file of `nbytes` in /dev/shm, its pages reserved; None where /dev/shm has no room."""
    path = os.path.join(SHM_DIR, f"ray-elastic-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        logger.info("no shared-memory allreduce: cannot create %s: %s", path, e)
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        logger.info("no shared-memory allreduce: %s has no room for %d MB: %s", SHM_DIR, nbytes // 2**20, e)
        return None
    os.close(fd)
    return path


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"{path} is smaller than {nbytes} bytes")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _dial_lower(rank: int, paths: list[str], timeout_s: float) -> dict[int, socket.socket]:
    """A connected stream socket to each rank below this one, which says this rank's number on it."""
    peers: dict[int, socket.socket] = {}
    try:
        for r, path in enumerate(paths):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peers[r] = s
            s.settimeout(timeout_s)
            s.connect(path)
            s.sendall(rank.to_bytes(4, "little"))
        return peers
    except BaseException:
        for s in peers.values():
            s.close()
        raise


def _accept_higher(listener: socket.socket, rank: int, size: int, timeout_s: float) -> dict[int, socket.socket]:
    """The sockets the ranks above this one dialled (already queued on the listener)."""
    peers: dict[int, socket.socket] = {}
    listener.settimeout(timeout_s)
    try:
        for _ in range(rank + 1, size):
            s, _ = listener.accept()
            s.settimeout(timeout_s)
            peers[int.from_bytes(_recv_exactly(s, 4), "little")] = s
        return peers
    except TimeoutError:
        for s in peers.values():
            s.close()
        late = sorted(set(range(rank + 1, size)) - set(peers))
        raise OSError(
            f"rank {rank} waited {timeout_s:g} s (collective_timeout) for the barrier links of ranks {late}, "
            "which said they had dialled"
        ) from None
    except BaseException:
        for s in peers.values():
            s.close()
        raise


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = s.recv(n - len(data))
        if not got:
            raise OSError("a peer closed its link while the shared-memory ring was built")
        data += got
    return data
