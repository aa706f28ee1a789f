"""What a `DataShard` hands out for a step's rows: the batch Ray Data's own `DataIterator` builds from them.

`shard.py` gathers this rank's rows of a step from the blocks they lie in;
from there every step is Ray Data's, called rather than copied, so that a
batch has the types, shapes, dtypes and values Ray's `iter_batches` /
`iter_torch_batches` give for the same rows:

- `concat`: the pieces into one block, as Ray's batcher does (the block's
  own builder: Arrow tables are concatenated with Ray's type unification,
  so tensor columns of different shapes become variable-shaped ones).
- `to_format`: `BlockAccessor.to_batch_format` ("default" is "numpy": a
  dict of numpy arrays, list and string and struct columns as object
  arrays; "pandas"; "pyarrow"; None: the block as it is).
- `TorchBatches`: `iter_torch_batches`'s conversion, decided once per call
  as Ray decides it: without `collate_fn`, Ray's `DefaultCollateFn` (an
  object column of equal-shaped arrays is stacked into one tensor; ragged,
  string and struct columns raise Ray's own error); with one, the format
  its class asks for (`ArrowBatchCollateFn`: a `pyarrow.Table`,
  `PandasBatchCollateFn`: a DataFrame, `NumpyBatchCollateFn` or a plain
  function: a dict of numpy arrays); then a batch of tensors moves to
  `device`.

The keywords are Ray's, with Ray's defaults (`check_iteration` refuses by
name the two that cannot hold when every rank takes its rows of each step
in lockstep). `RAY_NAMES` lists the names of Ray this module imports;
`tests/unit/test_data_batches.py` imports each, so a Ray upgrade that
moves one fails there, not in a run. Ray Data is imported when a batch is
first made (it is the `data` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_elastic.collective.devices import device_index, ray_gpu_ids, visible_devices
from ray_elastic.runtime.process import maybe_current

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

# every name of Ray imported here: Ray Data's block and collate interfaces (DeveloperAPI), its torch helpers
# (ray.data.util), and two private ones (the batch-format check, the pinning wrapper)
RAY_NAMES = (
    "ray.data.block.BlockAccessor",
    "ray.data.block._apply_batch_format",
    "ray.data.collate_fn.ArrowBatchCollateFn",
    "ray.data.collate_fn.DefaultCollateFn",
    "ray.data.collate_fn.NumpyBatchCollateFn",
    "ray.data.collate_fn.PandasBatchCollateFn",
    "ray.data.collate_fn._PinMemoryCollateFnWrapper",
    "ray.data.collate_fn.is_tensor_batch_type",
    "ray.data.util.torch_utils.DEFAULT_TENSOR_NON_BLOCKING_TRANSFER",
    "ray.data.util.torch_utils.move_tensors_to_device",
)


def check_iteration(batch_size: int | None, local_shuffle_buffer_size: int | None, prefetch_batches: int) -> int:
    """`batch_size`, once the keywords are checked: what an elastic shard cannot honour is refused by name."""
    if batch_size is None:
        raise ValueError(
            "batch_size=None (each block as one batch) cannot be honoured by an elastic dataset shard: every rank "
            "takes batch_size rows of each step in lockstep, so that a reset replays exactly the rows since the last "
            "commit; give an int"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if local_shuffle_buffer_size is not None:
        raise ValueError(
            f"local_shuffle_buffer_size={local_shuffle_buffer_size!r} cannot be honoured by an elastic dataset shard: "
            "a rank's rows of each step are fixed by the run's lockstep plan (a buffer would hold rows of later "
            "steps, which a reset could neither replay nor skip exactly); shuffle with get_dataset_shard(name, "
            "shuffle=True, seed=...) (ray_elastic's own: rows mixed across windows of 4 blocks, seeded per epoch) or "
            "ds.random_shuffle(seed=...)"
        )
    if not isinstance(prefetch_batches, int) or isinstance(prefetch_batches, bool):
        raise ValueError(f"prefetch_batches must be an int, got {prefetch_batches!r}")
    return batch_size


def batch_format_of(batch_format: str | None) -> str | None:
    """`batch_format` as Ray reads it: "default" is "numpy"; anything Ray does not know raises Ray's error."""
    from ray.data.block import _apply_batch_format

    return _apply_batch_format(batch_format)


def concat(blocks: Sequence[Any]) -> Any:
    """One block of `blocks`' rows in order, built as Ray's batcher builds a batch that spans blocks."""
    from ray.data.block import BlockAccessor

    if len(blocks) == 1:
        return blocks[0]
    builder = BlockAccessor.for_block(blocks[0]).builder()
    for block in blocks:
        builder.add_block(block)
    return builder.build()


def to_format(block: Any, batch_format: str | None) -> Any:
    """The block as a batch of `batch_format` (already read by `batch_format_of`)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_batch_format(batch_format)


@dataclass(frozen=True)
class TorchBatches:
    """How `iter_torch_batches` turns a step's block into what it hands out (see `torch_batches`)."""

    batch_format: str
    collate: Callable[[Any], Any]
    device: torch.device

    def __call__(self, block: Any) -> Any:
        from ray.data.collate_fn import is_tensor_batch_type
        from ray.data.util.torch_utils import DEFAULT_TENSOR_NON_BLOCKING_TRANSFER, move_tensors_to_device

        batch = self.collate(to_format(block, self.batch_format))
        if is_tensor_batch_type(batch):  # a collate_fn's other outputs are the user's to move, as in Ray
            batch = move_tensors_to_device(batch, device=self.device, non_blocking=DEFAULT_TENSOR_NON_BLOCKING_TRANSFER)
        return batch


def torch_batches(*, dtypes: Any, device: Any, collate_fn: Any, pin_memory: bool) -> TorchBatches:
    """Ray's decisions of `DataIterator.iter_torch_batches`, for one call (its errors, in its words).

    `device="auto"` is this worker's device (`worker_device`), where Ray's
    is Ray Train's device inside a Ray Train worker and the CPU elsewhere.
    """
    import torch
    from ray.data.collate_fn import (
        ArrowBatchCollateFn,
        DefaultCollateFn,
        NumpyBatchCollateFn,
        PandasBatchCollateFn,
        _PinMemoryCollateFnWrapper,
    )

    if collate_fn is not None and dtypes is not None:
        raise ValueError(
            "collate_fn cannot be used with dtypes. You should manually convert the output Torch tensors to the "
            "desired dtype inside collate_fn."
        )
    device = torch.device(worker_device() if device == "auto" else device)
    if torch.cuda.is_available() and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" alone follows the calling thread
    if collate_fn is None:
        # on the CPU one tensor per column at once; for a GPU a tensor per Arrow chunk, joined on the device
        collate, batch_format = DefaultCollateFn(dtypes=dtypes, combine_chunks=device.type == "cpu"), "pyarrow"
    elif isinstance(collate_fn, ArrowBatchCollateFn):
        collate, batch_format = collate_fn, "pyarrow"
    elif isinstance(collate_fn, PandasBatchCollateFn):
        collate, batch_format = collate_fn, "pandas"
    elif isinstance(collate_fn, NumpyBatchCollateFn) or callable(collate_fn):
        collate, batch_format = collate_fn, "numpy"
    else:
        raise ValueError(f"Unsupported collate function: {type(collate_fn)}")
    if pin_memory:
        collate = _PinMemoryCollateFnWrapper(collate)
    return TorchBatches(batch_format, collate, device)


def worker_device() -> torch.device:
    """This worker's device, as `ray_elastic.torch.get_device()` finds it: the GPU Ray gave it, else the CPU.

    (Found here rather than called: the data layer sits beside `torch`, not
    above it. Unlike `get_device()`, it leaves the current CUDA device be.)
    """
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return torch.device("cpu")
    ctx = maybe_current()
    gpu_ids = ray_gpu_ids()
    if ctx is not None and not gpu_ids:
        return torch.device("cpu")  # a Ray worker without a GPU of its own: the GPUs it sees are not its own
    slot = getattr(ctx, "slot", None) if ctx is not None else None
    local_rank = slot.local_rank if slot is not None else 0
    return torch.device("cuda", device_index(gpu_ids, visible_devices(), local_rank, torch.cuda.device_count()))
