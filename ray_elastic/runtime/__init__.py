"""The worker side: the runtime of one worker process, in parts with one job each.

`current()` (or `maybe_current()`, None outside a worker) is this process's
`WorkerContext`, typed: the public functions and the adapters (horovod, the
Ray Train API) find it there and call it by its named methods; the state
classes, the torch helpers and the run loop are handed it. What changes at
each reset it hands out as a `Generation` (`joined()`). These are the names
of the runtime meant for use outside it.

- `context`: `WorkerContext`, the process's parts behind one object;
- `generation`: `Generation`, one generation's number, slot and ring, as a value;
- `process`: which runtime this process runs;
- `membership`: the ready announce, joining and resetting rings, host-change notices and the
  agreement on them;
- `ring_ops`: the public collectives, on the current generation's ring;
- `commits`: which commit a rank holds, and whether it may adopt rank 0's;
- `checkpoint_cadence`: which commits become durable checkpoints, and resuming from one;
- `metrics_shipper`: rank 0's `report()` metrics and every rank's pace, shipped in the background;
- `pace`, `allocator`, `threads`: this rank's pace, its heap allocator, its torch threads.
"""

from ray_elastic.runtime.context import WorkerContext
from ray_elastic.runtime.generation import Generation
from ray_elastic.runtime.process import current, maybe_current

__all__ = ["Generation", "WorkerContext", "current", "maybe_current"]
