"""The worker side: the runtime of one worker process, in parts with one job each.

`current()` (or `maybe_current()`, None outside a worker) is this process's
`WorkerContext`, typed: the public functions, the torch helpers, the state
classes and the adapters (horovod) call it by its named methods. It is the
one name of the runtime meant for use outside it.

- `context`: `WorkerContext`, the parts behind one object;
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
from ray_elastic.runtime.process import current, maybe_current

__all__ = ["WorkerContext", "current", "maybe_current"]
