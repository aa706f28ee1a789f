"""The torch.distributed Gloo backend, the default on CPU.

A `TorchDistGroup` running Gloo: values stay where they are (numpy arrays
and CPU tensors are reduced in place, without a copy). Gloo reduces with a
bitwise or, so `bitwise_or_` is one allreduce instead of a gather.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ray_elastic.collective.torch_dist import TorchDistGroup


class TorchGlooGroup(TorchDistGroup):
    """A torch.distributed Gloo process group for one generation."""

    name = "gloo"
    backend = "gloo"
    abortable = True

    def bitwise_or_(self, value: np.ndarray) -> np.ndarray:
        if self.size == 1:
            return value
        tensor = torch.from_numpy(value)
        self._run("bitwise or", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.BOR, async_op=True))
        return value
