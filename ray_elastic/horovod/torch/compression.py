"""`hvd.Compression`: what a tensor travels as in `hvd.allreduce`.

`Compression.none` sends the tensor as it is; `Compression.fp16` sends
floating-point tensors as float16 and casts the result back (halving the
bytes on the wire, at float16's precision). A user compressor with Horovod's
interface (`compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx)`)
works in `hvd.allreduce` too.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: `compress(tensor) -> (compressed, ctx)` and `decompress(compressed, ctx) -> tensor`."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor as it is (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype; others as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """The compressors by Horovod's names: `Compression.none` and `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
