"""A dataset shard's batches against Ray's own `Dataset.iter_batches` / `iter_torch_batches` on the same Dataset.

One rank's `DataShard` reads its blocks through the run's feed code
(`data/feed.py`'s `Feed`, here in the test's process, its answers put in
the object store as the actor's are), so a batch crosses the same block
boundaries and slices a run's would. Each case compares every batch:
the same types, keys, shapes, dtypes, devices and values; where Ray raises
(a ragged or string column as a tensor), the same error.

The session's Ray when one is up, else one small local instance for this
module (one CPU, no dashboard).
"""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
ray_data = pytest.importorskip("ray.data")

from ray.data.collate_fn import ArrowBatchCollateFn, NumpyBatchCollateFn, PandasBatchCollateFn  # noqa: E402

import ray_elastic.data.shard as shard_module  # noqa: E402
from ray_elastic.data.feed import Feed  # noqa: E402

pytestmark = pytest.mark.integration

BATCH = 7  # rows per batch: batches straddle the datasets' blocks, and the last one is short
NAMES = [
    "lists from pandas",
    "tensors (n, 3, 4)",
    "tensors and labels",
    "ragged arrays",
    "shapes differing by block",
    "strings and dicts",
    "mixed",
]


@pytest.fixture(scope="module")
def ray_instance():
    if ray.is_initialized():
        yield
        return
    # address="local": a new instance of this module's own, never another Ray running on this machine
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def regression_frame(rows: int, start: int) -> pd.DataFrame:
    """Ray's regression example: 100 float features per row, a list in a pandas column."""
    ids = np.arange(start, start + rows)
    return pd.DataFrame({"x": [list(np.linspace(0, 1, 100) * i) for i in ids], "y": ids * 0.5})


def make_datasets() -> dict:
    images = np.arange(30 * 12, dtype=np.float32).reshape(30, 3, 4)
    return {
        "lists from pandas": ray_data.from_pandas([regression_frame(12, 0), regression_frame(11, 12)]),
        "tensors (n, 3, 4)": ray_data.from_numpy([images[:13], images[13:]]),
        "tensors and labels": ray_data.from_items([{"image": images[i], "label": i} for i in range(20)]),
        "ragged arrays": ray_data.from_items([{"v": np.arange(i % 4 + 1, dtype=np.int64)} for i in range(18)]),
        "shapes differing by block": ray_data.from_numpy([np.zeros((5, 3)), np.ones((6, 4))]),
        "strings and dicts": ray_data.from_items([{"s": f"row {i}", "d": {"k": i, "name": str(i)}} for i in range(15)]),
        "mixed": ray_data.from_items(
            [{"n": i, "f": i / 3, "s": str(i), "l": [i, i + 1], "t": np.full((2, 2), i)} for i in range(16)]
        ),
    }


@pytest.fixture(scope="module")
def datasets(ray_instance):
    """Each dataset with the feed of its run, the feed's thread executing each dataset once."""
    made = make_datasets()
    assert list(made) == NAMES
    feed = Feed(made, data_cpus=1, starvation_timeout=60.0)  # preserve_order, as in a run: Ray's iteration too
    return {name: (ds, _Handle(feed)) for name, ds in made.items()}


class _Put:
    def __init__(self, method) -> None:
        self.method = method

    def remote(self, *args):
        return ray.put(self.method(*args))


class _Handle:
    """The feed as a rank calls it: `handle.blocks.remote(...)` answers by the object store."""

    def __init__(self, feed: Feed) -> None:
        self.blocks, self.ref, self.release = _Put(feed.blocks), _Put(feed.ref), _Put(feed.release)


@pytest.fixture
def one_rank(monkeypatch):
    """This process as the single rank of a world of one."""
    slot = SimpleNamespace(joined=lambda: SimpleNamespace(slot=SimpleNamespace(rank=0, size=1)))
    monkeypatch.setattr(shard_module, "current", lambda: slot)


def outcome(make) -> tuple:
    """Every batch an iteration gives, or the error it raises (its type and words)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray's deprecation of a plain function as collate_fn
        try:
            return ("batches", list(make()))
        except Exception as e:  # noqa: BLE001 - the error is what is compared
            return ("raised", type(e), str(e))


def assert_same(ours, theirs, where: str = "batch") -> None:
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} where Ray gives {type(theirs).__name__}"
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} where Ray gives {list(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: {len(ours)} items where Ray gives {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.device) == (theirs.dtype, theirs.shape, theirs.device), where
        assert torch.equal(ours, theirs), f"{where}: values differ"
    elif isinstance(theirs, np.ndarray):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), f"{where}: {ours.dtype} {ours.shape}"
        if theirs.dtype == object:
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                assert_same(a, b, f"{where}[{i}]")
        else:
            assert np.array_equal(ours, theirs), f"{where}: values differ"
    elif isinstance(theirs, pd.DataFrame):
        assert list(ours.columns) == list(theirs.columns), f"{where}: columns"
        assert list(ours.dtypes) == list(theirs.dtypes), f"{where}: column dtypes"
        assert list(ours.index) == list(theirs.index), f"{where}: index"
        for column in theirs.columns:
            assert_same(ours[column].to_numpy(), theirs[column].to_numpy(), f"{where}[{column!r}]")
    elif isinstance(theirs, pa.Table):
        assert ours.schema == theirs.schema, f"{where}: schema {ours.schema} where Ray gives {theirs.schema}"
        assert ours.equals(theirs), f"{where}: values differ"
    else:
        assert ours == theirs, f"{where}: {ours!r} where Ray gives {theirs!r}"


def assert_same_outcome(ours: tuple, theirs: tuple) -> None:
    assert ours[0] == theirs[0], f"ours {ours[0]} {ours[1:] if ours[0] == 'raised' else ''}, Ray's {theirs[0]} " + (
        str(theirs[1:]) if theirs[0] == "raised" else ""
    )
    if theirs[0] == "raised":
        assert ours[1:] == theirs[1:]
    else:
        assert_same(ours[1], theirs[1], "batches")


def compare(datasets, name: str, method: str, **options) -> tuple:
    ds, feed = datasets[name]
    shard = shard_module.DataShard(name, feed)
    ours = outcome(lambda: getattr(shard, method)(batch_size=BATCH, **options))
    theirs = outcome(lambda: getattr(ds, method)(batch_size=BATCH, **options))
    assert_same_outcome(ours, theirs)
    return theirs


class Squares(NumpyBatchCollateFn):
    def __call__(self, batch):
        return {key: torch.as_tensor(np.stack(list(value)) ** 2) for key, value in batch.items() if key != "s"}


class Labels(ArrowBatchCollateFn):
    def __call__(self, batch):
        return torch.as_tensor(batch.column("label").to_numpy())


class Padded(NumpyBatchCollateFn):
    """Ragged rows padded to the batch's longest: what Ray's error tells a user to write."""

    def __call__(self, batch):
        rows = batch["v"]
        out = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return {"v": torch.as_tensor(out), "lengths": torch.as_tensor([len(r) for r in rows])}


class PandasRows(PandasBatchCollateFn):
    def __call__(self, batch):
        return (len(batch), list(batch.columns))  # not tensors: handed out as they are


def a_plain_function(batch):
    return [torch.as_tensor(np.stack(list(value))) for key, value in batch.items() if key in ("x", "data", "image")]


@pytest.mark.parametrize("batch_format", ["default", "numpy", "pandas", "pyarrow", None])
@pytest.mark.parametrize("name", NAMES)
def test_iter_batches_gives_what_rays_gives(datasets, one_rank, name, batch_format):
    compare(datasets, name, "iter_batches", batch_format=batch_format)


@pytest.mark.parametrize("name", NAMES)
def test_iter_batches_with_drop_last_drops_what_rays_drops(datasets, one_rank, name):
    theirs = compare(datasets, name, "iter_batches", drop_last=True)
    assert all(len(next(iter(batch.values()))) == BATCH for batch in theirs[1])


@pytest.mark.parametrize("name", NAMES)
def test_iter_torch_batches_gives_what_rays_gives(datasets, one_rank, name):
    theirs = compare(datasets, name, "iter_torch_batches")
    expected = {"lists from pandas": "batches", "tensors (n, 3, 4)": "batches", "tensors and labels": "batches"}
    assert theirs[0] == expected.get(name, "raised"), "the case covers what it means to: Ray converts it, or refuses"


@pytest.mark.parametrize(
    "name, options",
    [
        ("lists from pandas", {"dtypes": torch.float32}),
        ("lists from pandas", {"dtypes": {"x": torch.float16, "y": torch.int32}}),
        ("tensors and labels", {"dtypes": {"image": torch.float64, "label": torch.float32}}),
        ("tensors (n, 3, 4)", {"drop_last": True}),
        ("tensors and labels", {"device": "cpu", "prefetch_batches": 0}),
        ("lists from pandas", {"collate_fn": a_plain_function}),
        ("tensors and labels", {"collate_fn": Squares()}),
        ("ragged arrays", {"collate_fn": Padded()}),
        ("tensors and labels", {"collate_fn": Labels()}),
        ("strings and dicts", {"collate_fn": PandasRows()}),
        ("mixed", {"collate_fn": Squares()}),
        ("mixed", {"collate_fn": a_plain_function, "dtypes": torch.float32}),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(sorted(v)),
)
def test_iter_torch_batches_takes_rays_keywords_as_ray_takes_them(datasets, one_rank, name, options):
    compare(datasets, name, "iter_torch_batches", **options)
