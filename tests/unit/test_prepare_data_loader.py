"""`prepare_data_loader` without Ray: the user's DataLoader rebuilt, and exact through a rollback with no record call.

Ranks are simulated in one process (one loader each, in lockstep, their world
set by hand), as `ElasticSampler`'s own tests do; the cluster test
(tests/integration/test_schedulers_integration.py) runs it through real resets.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, UserDict, defaultdict
from collections.abc import Mapping
from typing import NamedTuple

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from ray_elastic.torch import ElasticSampler, prepare_data_loader
from ray_elastic.torch.data_loader import ElasticDataLoader
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


# ---- batch shapes: each moved whole to the worker's device (meta stands in for a GPU) ----------------------------

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Example:
    features: torch.Tensor
    extras: dict
    name: str = "batch"


class Frozen(Mapping):
    """A read-only Mapping built from a dict (as `types.MappingProxyType`-like user classes are)."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Movable:
    """A user's batch class that moves itself, and says which of its parts go."""

    def __init__(self, x: torch.Tensor, lengths: torch.Tensor) -> None:
        self.x, self.lengths = x, lengths

    def to(self, device):
        return Movable(self.x.to(device), self.lengths)  # lengths stay on the host, as its author wants


def _loader_yielding(batch) -> ElasticDataLoader:
    """A prepared loader of one batch, `batch` itself, moved to the meta device."""
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(1)), batch_size=1, collate_fn=lambda _: batch))
    loader.sampler.set_world(0, 1)
    loader.device = META
    return loader


def _moved(batch):
    (out,) = list(_loader_yielding(batch))
    return out


def test_a_user_dict_moves_and_keeps_its_type():
    out = _moved(UserDict(x=torch.ones(2), n=3))
    assert type(out) is UserDict and out["x"].device == META and out["n"] == 3


def test_a_batch_encoding_moves_and_keeps_its_encodings():
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)}, n_sequences=2)
    out = _moved(batch)
    assert isinstance(out, transformers.BatchEncoding) and out["input_ids"].device == META
    assert out.n_sequences == 2, "moved by its own .to(), which keeps the tokenizer's encodings"


def test_dict_types_keep_their_type_and_factory():
    moved = _moved(defaultdict(list, x=torch.ones(1)))
    assert type(moved) is defaultdict and moved.default_factory is list and moved["x"].device == META
    ordered = _moved(OrderedDict(b=torch.ones(1), a=torch.ones(1)))
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"] and ordered["a"].device == META


def test_another_mapping_is_rebuilt_as_its_type():
    out = _moved(Frozen({"x": torch.ones(1)}))
    assert type(out) is Frozen and out["x"].device == META


def test_a_dataclass_moves_nested_and_keeps_its_other_fields():
    out = _moved(Example(torch.ones(2), {"mask": [torch.ones(1)]}, name="b0"))
    assert type(out) is Example and out.name == "b0"
    assert out.features.device == META and out.extras["mask"][0].device == META


def test_a_namedtuple_of_a_dataclass_and_a_user_dict_moves_all_the_way_down():
    out = _moved(Pair(Example(torch.ones(1), {}), UserDict(y=torch.ones(1))))
    assert type(out) is Pair and out.x.features.device == META and out.y["y"].device == META


def test_an_object_that_moves_itself_is_asked_to():
    out = _moved(Movable(torch.ones(2), torch.tensor([2])))
    assert out.x.device == META and out.lengths.device.type == "cpu"
    packed = pack_padded_sequence(torch.ones(3, 2, 4), [3, 2])
    out = _moved(packed)
    assert type(out) is PackedSequence and out.data.device == META
    assert out.batch_sizes.device.type == "cpu", "a PackedSequence keeps its batch sizes on the host"
