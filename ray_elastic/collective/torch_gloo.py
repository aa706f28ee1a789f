"""The torch.distributed Gloo backend, the default on CPU.

A `TorchDistGroup` running Gloo: values stay where they are (numpy arrays
and CPU tensors are reduced in place, without a copy).
"""

from __future__ import annotations

from ray_elastic.collective.torch_dist import TorchDistGroup


class TorchGlooGroup(TorchDistGroup):
    """A torch.distributed Gloo process group for one generation."""

    name = "gloo"
    backend = "gloo"
