"""Horovod's `State` and `ObjectState` signatures over ray-elastic's states.

Horovod's base classes take `(bcast_object, get_rank)` first, and call a
`reset()` hook before the reset callbacks. Here the broadcast and the rank
are always ray-elastic's (rank 0, the oldest survivor, is the source of every
sync), so the two arguments are accepted and not needed; `reset()` is kept.
`State`, `ObjectState` and `TorchState` of `ray_elastic.horovod.torch.elastic`
are built on `HorovodStateMixin`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray_elastic

if TYPE_CHECKING:
    from collections.abc import Callable


class HorovodStateMixin:
    """Horovod's `reset()` hook: called after every reset, before the reset callbacks."""

    def reset(self) -> None:
        """Reset objects after a membership change, before the state syncs; nothing by default."""

    def on_reset(self) -> None:
        self.reset()
        super().on_reset()  # type: ignore[misc]


class State(HorovodStateMixin, ray_elastic.State):
    """Base class of a user state: subclasses implement `save`, `restore` and `sync`.

    Args:
        bcast_object, get_rank: accepted for Horovod's signature; ray-elastic's
            `broadcast_object` and `rank` are used either way.
    """

    def __init__(
        self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None
    ) -> None:
        ray_elastic.State.__init__(self)


class ObjectState(HorovodStateMixin, ray_elastic.ObjectState):
    """Picklable attributes: `ObjectState(epoch=0, batch=0)`, or Horovod's `ObjectState(bcast, get_rank, **kw)`."""

    def __init__(
        self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None, **kwargs: Any
    ) -> None:
        ray_elastic.ObjectState.__init__(self, **kwargs)
