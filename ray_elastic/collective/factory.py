"""The backend factory: from a backend's name to a checked import and one generation's ring.

Each backend's module imports an optional dependency (torch for "gloo" and
"nccl", pygloo for "pygloo"), so they are imported here on first use, never
at module level: a numpy-only worker never loads torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from ray_elastic.collective import address, devices
from ray_elastic.exceptions import HorovodInternalError, RendezvousTimeoutError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.collective.base import CollectiveGroup
    from ray_elastic.rendezvous import KVClient

logger = logging.getLogger(__name__)

_SEAT_PREFIX = "gpu_seat/"  # a rank's (worker, node, GPU ids), read by every rank of the generation
_said: set[str] = set()  # backend plans already logged by this process

# the backends whose rings are torch.distributed process groups (what torch helpers may rely on)
TORCH_BACKENDS = ("gloo", "nccl")


def load_backend(backend: str) -> None:
    """Import the backend's libraries (torch: seconds in a fresh process) and check this worker can run it.

    A newcomer does this before it says it is ready, so the ring never waits
    for a member's imports.
    """
    if backend == "gloo":
        import ray_elastic.collective.torch_gloo  # noqa: F401 - optional dependency (torch)
    elif backend == "pygloo":
        try:
            import ray_elastic.collective.pygloo_backend  # noqa: F401 - optional dependency (pygloo)
        except ImportError as e:
            raise RuntimeError(
                f"backend 'pygloo' cannot be imported in this worker ({e}); pygloo has wheels up to Python 3.10: "
                "pip install pygloo==0.2.1 (Python <= 3.10; the 'pygloo' extra of ray-elastic)"
            ) from e
    elif backend == "nccl":
        from ray_elastic.collective import nccl  # optional dependency (torch)

        nccl.load()
    else:
        raise ValueError(f"unknown backend {backend!r}")


def make_group(
    backend: str,
    kv: KVClient,
    generation: int,
    rank: int,
    size: int,
    timeout: float,
    local_rank: int = 0,
    requested: str = "auto",
    worker_id: str = "",
    note: Callable[[str], None] | None = None,
) -> CollectiveGroup:
    """Build the ring for `generation` with the chosen backend (`local_rank` picks an NCCL worker's GPU).

    Before an NCCL ring of several ranks forms, the ranks compare the GPUs
    Ray gave them (`devices.plan_backend`): ranks sharing a GPU run torch
    Gloo instead when `requested` is "auto", and raise `DeviceConflictError`
    when it is "nccl". Gloo rings (torch's and pygloo) listen on the Ray
    node's IP (see `address`); one that does not form says where each rank
    listened.
    """
    if backend == "nccl" and size > 1:
        backend = _plan_gpu_ring(kv, generation, rank, size, timeout, requested, worker_id, note)
    if backend == "nccl":
        # optional dependency (torch)
        from ray_elastic.collective.nccl import TorchNcclGroup
        from ray_elastic.collective.torch_store import torch_store

        # no one-call family reads: NCCL's unique id is one key `<prefix>/0` that only rank 0 writes,
        # which the family read (made for Gloo's every-rank addresses) would wait on with N-1 keys missing
        return TorchNcclGroup(torch_store(kv, generation, timeout), rank, size, timeout, local_rank)
    if backend not in ("gloo", "pygloo"):
        raise ValueError(f"unknown backend {backend!r}")
    binding = address.gloo_binding(ray.util.get_node_ip_address())
    if size > 1:
        kv.post(generation, address.address_key(rank), binding.describe().encode())  # read only on failure
    try:
        if backend == "gloo":
            # optional dependency (torch)
            from ray_elastic.collective.torch_gloo import TorchGlooGroup
            from ray_elastic.collective.torch_store import torch_store

            with address.socket_ifname(binding):
                return TorchGlooGroup(torch_store(kv, generation, timeout, size), rank, size, timeout)
        from ray_elastic.collective.pygloo_backend import PyglooGroup  # optional dependency (pygloo)

        return PyglooGroup(kv, generation, rank, size, timeout, binding)
    except (HorovodInternalError, RendezvousTimeoutError) as e:
        hint = address.ring_failure_hint(binding, rank, _advertised(kv, generation, size))
        raise type(e)(f"{e}; {hint}") from e


def _plan_gpu_ring(
    kv: KVClient,
    generation: int,
    rank: int,
    size: int,
    timeout: float,
    requested: str,
    worker_id: str,
    note: Callable[[str], None] | None = None,
) -> str:
    """The backend of an NCCL run's ring for `generation`, from every rank's GPUs (one KV call per rank).

    A plan that departs from NCCL is logged once per process, and rank 0
    hands its reason to `note` (the run's driver makes it an event the user sees).
    """
    seat = devices.GpuSeat(
        worker_id or f"rank {rank}", ray.get_runtime_context().get_node_id(), tuple(devices.ray_gpu_ids())
    )
    posted = kv.wait_family(generation, _SEAT_PREFIX, size, timeout, put=(f"{_SEAT_PREFIX}{rank}", seat.encode()))
    plan = devices.plan_backend("nccl", requested, {r: devices.GpuSeat.decode(raw) for r, raw in enumerate(posted)})
    if plan.reason and plan.reason not in _said:
        _said.add(plan.reason)  # once per process: every generation of this placement plans the same
        logger.log(logging.WARNING if rank == 0 else logging.INFO, "generation %d: %s", generation, plan.reason)
        if rank == 0 and note is not None:
            note(plan.reason)
    return plan.backend


def _advertised(kv: KVClient, generation: int, size: int) -> dict[int, str]:
    """The addresses the ranks of `generation` wrote so far (a failure path: never waits long)."""
    found: dict[int, str] = {}
    for r in range(size):
        key = address.address_key(r)
        try:
            if kv.check(generation, [key]):
                found[r] = kv.get(generation, key, 1.0).decode()
        except Exception:  # noqa: BLE001 - the KV actor may be the thing that failed: say what is known
            break
    return found
