"""`prepare_data_loader` without Ray: the user's DataLoader rebuilt, and exact through a rollback with no record call.

Ranks are simulated in one process (one loader each, in lockstep, their world
set by hand), as `ElasticSampler`'s own tests do; the cluster test
(tests/integration/test_schedulers_integration.py) runs it through real resets.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from ray_elastic.torch import ElasticSampler, prepare_data_loader
from ray_elastic.torch.state import TorchState

N, BS = 50, 4


def _collate(batch):
    return torch.stack([b[0] for b in batch])


def test_the_loader_keeps_its_dataset_batch_size_collate_and_workers_and_shuffles_as_it_did():
    ds = TensorDataset(torch.arange(N))
    loader = DataLoader(ds, batch_size=BS, shuffle=True, collate_fn=_collate, num_workers=0, drop_last=False)
    prepared = prepare_data_loader(loader, seed=3)
    assert prepared.dataset is ds and prepared.batch_size == BS and prepared.collate_fn is _collate
    assert prepared.num_workers == 0 and isinstance(prepared.sampler, ElasticSampler)
    assert prepared.sampler.shuffle and prepared.sampler.seed == 3
    assert not prepare_data_loader(DataLoader(ds, batch_size=BS)).sampler.shuffle
    prepared.sampler.set_world(0, 1)
    assert sorted(torch.cat(list(prepared)).tolist()) == list(range(N))


def test_what_cannot_be_split_exactly_is_refused_naming_it():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    ds = TensorDataset(torch.arange(N))
    with pytest.raises(TypeError, match="map-style"):
        prepare_data_loader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        prepare_data_loader(DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * N, N)))
    with pytest.raises(ValueError, match="batch_size"):
        prepare_data_loader(DataLoader(ds, batch_size=None))
    with pytest.raises(TypeError, match="DataLoader"):
        prepare_data_loader([1, 2, 3])


def _ranks(size: int, states: list[TorchState] | None = None) -> list[TorchState]:
    """`size` ranks' states, each holding a prepared loader (a newcomer receives rank 0's position)."""
    out = []
    for rank in range(size):
        loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BS, shuffle=True))
        if states is not None and rank < len(states):
            loader = states[rank].loader
        elif states is not None:
            loader.sampler.load_state_dict(states[0].loader.sampler.state_dict())  # the newcomer's sync
        loader.sampler.set_world(rank, size)
        out.append(TorchState(loader=loader) if states is None or rank >= len(states) else states[rank])
    return out


def test_every_sample_once_through_a_rollback_and_a_new_world_with_no_record_call():
    trained: list[list[int]] = []  # what survived: batches not undone by the rollback
    ranks = _ranks(2)
    its = [iter(s.loader) for s in ranks]
    for _ in range(2):  # batches 0 and 1 trained on both ranks
        trained += [next(it)[0].tolist() for it in its]
    for s in ranks:
        s.save()  # a commit after batch 1's step: batch 0 counted when batch 1 was taken, batch 1 now
    for it in its:
        next(it)  # batch 2 trained, then a rank fails before the next commit
    for s in ranks:
        s.restore()
    assert ranks[0].loader.sampler.num_processed == 2 * 2 * BS, "the rolled-back batch counted as processed"
    ranks = _ranks(3, ranks)  # the survivors and a newcomer, in a world of three
    for batches in zip(*(iter(s.loader) for s in ranks), strict=True):
        trained += [b[0].tolist() for b in batches]
    seen = Counter(i for batch in trained for i in batch)
    assert set(seen) == set(range(N)), f"never trained: {set(range(N)) - set(seen)}"
    padding = ranks[0].loader.sampler.padding_trained
    assert sum(seen.values()) - N == padding, f"{sum(seen.values()) - N} repeats, {padding} of them padding"
    assert ranks[0].loader.sampler.num_remaining == 0, "the loop came back after the last batch: all counted"
