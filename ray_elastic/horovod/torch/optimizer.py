"""`hvd.DistributedOptimizer` with Horovod's signature, on ray-elastic's bucketed optimizer.

What each of Horovod's arguments does here:

- `named_parameters`: names for messages; checked as Horovod does (pairs,
  unique names, every parameter of the optimizer named).
- `backward_passes_per_step`: local accumulation before the allreduce (the
  accumulated gradient is the sum over the passes, as in Horovod).
- `op`: `hvd.Average` (default) or `hvd.Sum`; `hvd.Adasum` raises
  `NotImplementedError`.
- `gradient_predivide_factor`: Horovod splits the averaging into a division
  by the factor before the sum and by `size / factor` after it: the same
  average up to rounding. Here the average is taken in one division, so the
  factor is checked (> 0, only with `op=hvd.Average`, as in Horovod) and the
  result is that average.
- `compression`: `Compression.none`; with `Compression.fp16` the gradients
  are reduced in their own precision (the fused buckets have no float16 wire
  format), which a warning says once: the results are at least as precise.
- `groups`, `num_groups`: Horovod's fusion grouping; the buckets here are
  formed by size (`bucket_cap_mb`), so these change nothing in the result.
- `sparse_as_dense`: accepted; the buckets reduce dense gradients only, so
  a model with sparse gradients (`nn.Embedding(sparse=True)`) is not
  supported either way.
- `process_set`: only `hvd.global_process_set`.

`synchronize()` and `skip_synchronize()` work as in Horovod: call
`synchronize()` to have the averaged gradients before `step()` (to clip
them), then step inside `with optimizer.skip_synchronize():`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ray_elastic import Average, Sum
from ray_elastic.horovod.torch.compression import Compression
from ray_elastic.horovod.torch.ops import check_process_set, global_process_set, reduce_op
from ray_elastic.torch import DistributedOptimizer as _ElasticOptimizer

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    import torch

logger = logging.getLogger(__name__)


class _HorovodOptimizer(_ElasticOptimizer):
    """ray-elastic's optimizer plus Horovod's `skip_synchronize()`; a step never reduces the gradients twice."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self._skip_synchronize = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside this block does not synchronize again (after an explicit `synchronize()`)."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure: Any = None) -> Any:
        if self._synchronized and not self._skip_synchronize:
            # Horovod warns and reduces again; the gradients are reduced already, so step on them as they are
            logger.warning(
                "optimizer.step() after optimizer.synchronize() outside `with optimizer.skip_synchronize():`; "
                "the gradients were reduced already and are used as they are"
            )
        return super().step(closure)


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Wrap `optimizer` so that `step()` averages the gradients over all ranks first (see the module doc)."""
    reduce = reduce_op(op, where="DistributedOptimizer")
    if reduce not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and reduce is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_process_set(process_set, "DistributedOptimizer")
    if compression not in (Compression.none, Compression.fp16):
        raise NotImplementedError(
            f"DistributedOptimizer(compression={compression!r}) is not supported: gradients travel in the "
            "fused buckets' own format; Compression.none and Compression.fp16 are accepted"
        )
    if compression is Compression.fp16:
        logger.warning(
            "DistributedOptimizer(compression=hvd.Compression.fp16): gradients are reduced in their own "
            "precision here (no float16 wire format for the fused buckets); the results are at least as precise"
        )
    named = _checked_names(optimizer, named_parameters)
    return _HorovodOptimizer(
        optimizer,
        named_parameters=named,
        backward_passes_per_step=backward_passes_per_step,
        op=reduce,
    )


def _checked_names(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> list[tuple[str, torch.Tensor]] | None:
    """Horovod's checks of `named_parameters`: (name, tensor) pairs, unique names, every parameter named."""
    if named_parameters is None:
        return None
    named = list(named_parameters)
    if any(not isinstance(p, tuple) or len(p) != 2 for p in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()"
        )
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(duplicates)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError(
            f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters are not in it "
            f"(shapes {[tuple(p.shape) for p in unnamed][:5]})"
        )
    return named
