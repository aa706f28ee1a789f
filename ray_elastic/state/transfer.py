"""The collective half of a sync: agreeing on the commit, and handing objects to the ranks that lack it.

- `agree` is one allreduce of one int64 per rank (each rank writes its
  commit's fingerprint into its own slot), after which every rank knows the
  `SyncPlan`: after a failure with no newcomer, nobody receives anything.
- `share_object` sends rank 0's picklable object to the receivers only, as
  two point-to-point messages each (length, then bytes); on a backend without
  point-to-point messages (pygloo) it falls back to the ring's
  `broadcast_object`, which every rank joins.

Tensors go through `ray_elastic.torch.broadcast.send_tensors_`, in chunks.
Every wait is bounded by the ring's `collective_timeout`.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_elastic.collective.base import CollectiveGroup, Sum
from ray_elastic.state.sync_plan import SyncPlan, plan_sync

if TYPE_CHECKING:
    from ray_elastic.runtime.commits import CommitId


def agree(ring: CollectiveGroup, commit: CommitId) -> SyncPlan:
    """Which ranks hold rank 0's commit: one tiny allreduce."""
    slots = np.zeros(ring.size, dtype=np.int64)
    slots[ring.rank] = commit.fingerprint()
    if ring.size > 1:
        ring.allreduce_(slots, Sum)
    return plan_sync(slots.tolist(), ring.rank)


def share_object(ring: CollectiveGroup, plan: SyncPlan, obj: Any) -> Any:
    """Rank 0's `obj` on the receivers (returned there); the other ranks get None."""
    if not plan.moves_state:
        return None
    if not ring.point_to_point:
        shared = ring.broadcast_object(obj if ring.rank == 0 else None, root_rank=0)
        return shared if plan.receives else None
    if ring.rank == 0:
        payload = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)
        length = np.array([payload.size], dtype=np.int64)
        works = []
        for r in plan.receivers:
            works.append(ring.send_async(length, r))
            works.append(ring.send_async(payload, r))
        for w in works:
            w.wait()
        return None
    if not plan.receives:
        return None
    length = np.zeros(1, dtype=np.int64)
    ring.recv_async(length, 0).wait()
    payload = np.empty(int(length[0]), dtype=np.uint8)
    ring.recv_async(payload, 0).wait()
    return pickle.loads(payload.tobytes())
