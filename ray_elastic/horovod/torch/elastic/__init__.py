"""`hvd.elastic`: `run`, `State`, `ObjectState`, `TorchState` and `ElasticSampler` with Horovod's names.

`run` is ray-elastic's loop (sync from rank 0, call, restore the last commit
on `HorovodInternalError`, keep the live state on `HostsUpdatedInterrupt`,
rebuild the ring, reset callbacks). The states are ray-elastic's with
Horovod's constructor signatures and its `reset()` hook; `ElasticSampler` is
ray-elastic's, whose `record_batch(batch_idx, batch_size)` and
`set_epoch(epoch)` Horovod scripts call, and whose progress survives any
rank's death.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray_elastic.torch
from ray_elastic import run
from ray_elastic.horovod.common.elastic import HorovodStateMixin, ObjectState, State
from ray_elastic.torch import ElasticSampler

if TYPE_CHECKING:
    import torch


class TorchState(HorovodStateMixin, ray_elastic.torch.TorchState):
    """`TorchState(model, optimizer, **kwargs)`: a model, its optimizer and any other values (samplers too).

    Attributes read and write through (`state.epoch = 3`); `commit()` saves
    them in memory and checks for host updates.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        ray_elastic.torch.TorchState.__init__(self, model=model, optimizer=optimizer, **kwargs)


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
