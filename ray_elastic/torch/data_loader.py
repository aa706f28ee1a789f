"""`prepare_data_loader`: a user's `DataLoader`, exact per epoch through every reset, with no bookkeeping call.

Ray Train's name and shape: the loader is rebuilt over the same dataset, batch
size, collate function and worker processes, with an `ElasticSampler` in
place of its sampler (shuffling if the loader shuffled). Each batch the loop
takes is held by the sampler (`hold_batch`) and counts as trained when the
loop comes back for the next one, or at a commit after its step, whichever
comes first; a rollback before either hands it out again. A pass the loop
ran to its end leaves the next one whole (an evaluation loader iterated every
epoch), while a pass cut by a rollback resumes where it was. So a plain
`for x, y in loader:` loop needs no `record_batch`. Batches move to the
worker's GPU where it has one.

Keep the loader (or its `sampler`) in the `TorchState`: its position is then
committed, rolled back and handed to newcomers like the rest of the state.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections import UserDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ray_elastic.torch.device import get_device
from ray_elastic.torch.sampler import ElasticSampler

if TYPE_CHECKING:
    from collections.abc import Iterator


def prepare_data_loader(loader: DataLoader, seed: int = 0, move_to_device: bool = True) -> ElasticDataLoader:
    """The same loader, sharded over the elastic world and exact through resets (see the module doc).

    Args:
        loader: a `torch.utils.data.DataLoader` over a map-style dataset, with
            its default sampler (`shuffle=True` or not) and a `batch_size`.
        seed: the shuffle's seed, combined with the epoch (the same on every rank).
        move_to_device: move each batch's tensors to the worker's GPU, where it has one: in tensors,
            Mappings, namedtuples, tuples, lists, dataclasses, nested, and objects with a `.to(device)`.

    Raises `TypeError`/`ValueError` naming what cannot be sharded exactly: an
    iterable dataset, a custom sampler or batch sampler, no batch size.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"prepare_data_loader takes a torch DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "prepare_data_loader needs a map-style dataset (with __len__ and indices); for a stream use "
            "ElasticTrainer(datasets=...) and ray_elastic.get_dataset_shard"
        )
    if loader.batch_size is None:
        raise ValueError("prepare_data_loader needs the DataLoader's batch_size (a batch_sampler cannot be split)")
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            "prepare_data_loader replaces the DataLoader's sampler, and this one is a "
            f"{type(loader.sampler).__name__}: build the DataLoader with shuffle=True or False, "
            "or use ElasticSampler yourself"
        )
    sampler = ElasticSampler(loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), seed=seed)
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
    device = _worker_device() if move_to_device else None
    return ElasticDataLoader(rebuilt, sampler, device)


def _worker_device() -> torch.device | None:
    """The GPU this worker was given (`get_device()`), or None on CPU (nothing to move)."""
    device = get_device()
    return device if device.type != "cpu" else None


def _to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device`, each container rebuilt as its own type.

    The rule, in order: a tensor moves; any other object that moves itself
    (`.to`: HF's `BatchEncoding`, `PackedSequence`, the user's own batch
    classes) is asked to, as it knows which of its parts belong on the device
    (a `PackedSequence`'s `batch_sizes` stay on the CPU); dicts and `UserDict`s
    are copied (keeping their type and attributes: a `defaultdict`'s factory)
    with their values moved; other Mappings are rebuilt as their type where it
    takes a dict, else as a dict; namedtuples, tuples and lists as their type;
    dataclasses through `dataclasses.replace`; anything else is left as it is.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if not isinstance(batch, type) and callable(getattr(batch, "to", None)):
        return batch.to(device, non_blocking=True) if _takes_non_blocking(batch.to) else batch.to(device)
    if isinstance(batch, (dict, UserDict)):
        moved = copy.copy(batch)
        for key, value in batch.items():
            moved[key] = _to_device(value, device)
        return moved
    if isinstance(batch, Mapping):
        items = {key: _to_device(value, device) for key, value in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # a concrete Mapping, built from a dict
        except TypeError:  # a Mapping that is not built from a dict: its items, in a dict
            return items
    if isinstance(batch, (list, tuple)):
        moved_items = [_to_device(b, device) for b in batch]
        return type(batch)(*moved_items) if hasattr(batch, "_fields") else type(batch)(moved_items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: _to_device(getattr(batch, f.name), device) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **fields)
    return batch


def _takes_non_blocking(method: Any) -> bool:
    """Whether `method` accepts `non_blocking=` (a pinned batch's copy then overlaps the step)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "non_blocking" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class ElasticDataLoader:
    """Iterates like the `DataLoader` it wraps; each batch counts as trained once the loop moves past it."""

    def __init__(self, loader: DataLoader, sampler: ElasticSampler, device: torch.device | None) -> None:
        self.loader = loader
        self.sampler = sampler
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        batch_size = self.loader.batch_size
        for i, batch in enumerate(self.loader):
            self.sampler.hold_batch(i, batch_size)  # counts batch i - 1: the loop came back for this one
            yield batch if self.device is None else _to_device(batch, self.device)
        self.sampler.end_pass()  # the loop came back after the last batch: counted, and the next pass is whole

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (as `ElasticSampler.set_epoch`: setting the current one keeps the progress)."""
        self.sampler.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)  # dataset, batch_size, num_workers, collate_fn ...
