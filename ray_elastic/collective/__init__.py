"""The ring's backends, behind one interface (`base.CollectiveGroup`), and the reduce ops.

Three backends: torch.distributed Gloo (`torch_gloo.py`, the default on CPU),
pygloo (`pygloo_backend.py`) and NCCL (`nccl.py`); `factory.py` builds the
one a run asked for, its store served by the run's KV actor. `checked.py`
checks and agrees on the arguments of the public collectives; `shm.py`
reduces through shared memory between the ranks of one node.

The public collectives (`ray_elastic.allreduce`, ...) run on the current
generation's ring, which the worker runtime owns: they live in
`runtime/ring_ops.py`. This package knows nothing of the runtime.
"""

from __future__ import annotations

from ray_elastic.collective.base import Average, CollectiveGroup, Max, Min, ReduceOp, Sum
from ray_elastic.collective.checked import argument_checks_enabled, set_argument_checks
from ray_elastic.exceptions import CollectiveMismatchError

__all__ = [
    "Average",
    "CollectiveGroup",
    "CollectiveMismatchError",
    "Max",
    "Min",
    "ReduceOp",
    "Sum",
    "argument_checks_enabled",
    "set_argument_checks",
]
