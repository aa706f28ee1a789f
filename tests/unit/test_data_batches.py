"""A dataset shard's batches as Ray Data builds them (`data/batches.py`), on blocks made here: no Ray instance.

Ray's own conversion runs here on blocks made in the test; the parity with
Ray's `DataIterator` on the same `Dataset` is
`tests/integration/test_data_batches.py`. The shard's own iteration
(drop_last, prefetch_batches, batches across blocks) runs on a feed that
answers in place and blocks that never leave this process.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
ray_data = pytest.importorskip("ray.data")

from ray.data.collate_fn import ArrowBatchCollateFn, NumpyBatchCollateFn, PandasBatchCollateFn  # noqa: E402

import ray_elastic.data.shard as shard_module  # noqa: E402
from ray_elastic.data import batches  # noqa: E402
from ray_elastic.data.shard import DataShard  # noqa: E402

DATA = Path(batches.__file__).parent


# ---- the names of Ray this library imports ------------------------------------------------------------------


@pytest.mark.parametrize("name", batches.RAY_NAMES)
def test_every_name_of_ray_the_batches_use_is_where_the_installed_ray_keeps_it(name):
    module, _, attr = name.rpartition(".")
    assert hasattr(importlib.import_module(module), attr), f"Ray moved {name}: batches.py needs its new place"


def test_the_shard_and_its_batches_import_from_ray_data_only_the_listed_names():
    imported = set()
    for path in (DATA / "batches.py", DATA / "shard.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray.data"):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    assert imported == set(batches.RAY_NAMES)


@pytest.mark.parametrize("method", ["iter_batches", "iter_torch_batches"])
def test_the_shard_takes_every_keyword_of_rays_data_iterator_with_rays_default(method):
    ray_params = inspect.signature(getattr(ray_data.DataIterator, method)).parameters
    ours = inspect.signature(getattr(DataShard, method)).parameters
    assert set(ours) == set(ray_params), "the same keywords as Ray's DataIterator, no more, no fewer"
    for name, param in ray_params.items():
        if name != "self":
            assert ours[name].default == param.default, f"{method}({name}=...) defaults as Ray's"


# ---- conversion: Ray's rules on blocks ------------------------------------------------------------------------


def torch_batch(block, **options):
    options = {"dtypes": None, "device": "auto", "collate_fn": None, "pin_memory": False, **options}
    return batches.torch_batches(**options)(block)


def test_a_pandas_column_of_equal_length_lists_becomes_one_float64_tensor_per_batch():
    # the shape of Ray's regression example: 100 features per row, as lists in a pandas column
    frame = pd.DataFrame({"x": [list(np.arange(100.0) + i) for i in range(8)], "y": np.arange(8.0)})
    batch = torch_batch(frame)
    assert batch["x"].dtype == torch.float64 and batch["x"].shape == (8, 100)
    assert torch.equal(batch["x"][3], torch.arange(100.0, dtype=torch.float64) + 3)
    assert batch["y"].dtype == torch.float64 and batch["y"].shape == (8,)


def test_a_tensor_column_keeps_its_shape_and_dtypes_apply_as_one_or_per_column():
    frame = pd.DataFrame({"image": list(np.arange(6 * 12, dtype=np.float32).reshape(6, 3, 4)), "label": range(6)})
    block = batches.to_format(frame, "pyarrow")  # Ray's tensor extension type, as a dataset holds it
    batch = torch_batch(block)
    assert batch["image"].shape == (6, 3, 4) and batch["image"].dtype == torch.float32
    assert batch["label"].dtype == torch.int64
    assert torch_batch(block, dtypes=torch.float16)["label"].dtype == torch.float16
    by_column = torch_batch(block, dtypes={"image": torch.float64, "label": torch.int32})
    assert (by_column["image"].dtype, by_column["label"].dtype) == (torch.float64, torch.int32)


def test_pieces_with_tensors_of_different_shapes_join_as_rays_variable_shaped_tensors():
    a = batches.to_format(pd.DataFrame({"t": list(np.zeros((2, 3)))}), "pyarrow")
    b = batches.to_format(pd.DataFrame({"t": list(np.ones((2, 4)))}), "pyarrow")
    joined = batches.to_format(batches.concat([a, b]), "numpy")["t"]
    assert joined.dtype == object and [len(row) for row in joined] == [3, 3, 4, 4]
    with pytest.raises(RuntimeError, match="ragged tensor"):  # Ray's own refusal: a collate_fn decides
        torch_batch(batches.concat([a, b]))


@pytest.mark.parametrize(
    "column, error",
    [
        ([[1, 2], [3]], RuntimeError),  # ragged lists
        (["a", "b"], TypeError),  # strings
        ([{"k": 1}, {"k": 2}], RuntimeError),  # dicts (a struct column)
    ],
)
def test_columns_torch_cannot_hold_raise_rays_error_and_iter_batches_passes_them_as_objects(column, error):
    table = pa.table({"c": column})
    with pytest.raises(error):
        torch_batch(table)
    passed = batches.to_format(table, batches.batch_format_of("default"))["c"]
    assert passed.dtype == object and len(passed) == 2


def test_a_collate_fn_gets_the_batch_format_its_class_asks_for():
    seen = {}

    class Arrow(ArrowBatchCollateFn):
        def __call__(self, batch):
            seen["arrow"] = type(batch)
            return torch.as_tensor(batch["x"].to_numpy())

    class Pandas(PandasBatchCollateFn):
        def __call__(self, batch):
            seen["pandas"] = type(batch)
            return {"x": torch.as_tensor(batch["x"].to_numpy())}

    class Numpy(NumpyBatchCollateFn):
        def __call__(self, batch):
            seen["numpy"] = type(batch)
            return [torch.as_tensor(batch["x"])]

    def plain(batch):
        seen["plain"] = type(batch)
        return "not tensors: handed out as they are"

    block = pa.table({"x": [1, 2, 3]})
    assert torch.equal(torch_batch(block, collate_fn=Arrow()), torch.tensor([1, 2, 3]))
    assert torch.equal(torch_batch(block, collate_fn=Pandas())["x"], torch.tensor([1, 2, 3]))
    assert torch.equal(torch_batch(block, collate_fn=Numpy())[0], torch.tensor([1, 2, 3]))
    assert torch_batch(block, collate_fn=plain) == "not tensors: handed out as they are"
    assert seen == {"arrow": pa.Table, "pandas": pd.DataFrame, "numpy": dict, "plain": dict}


def test_rays_refusals_of_iter_torch_batches_are_kept_in_rays_words():
    with pytest.raises(ValueError, match="collate_fn cannot be used with dtypes"):
        batches.torch_batches(dtypes=torch.float32, device="cpu", collate_fn=lambda b: b, pin_memory=False)
    with pytest.raises(ValueError, match="Unsupported collate function"):
        batches.torch_batches(dtypes=None, device="cpu", collate_fn=42, pin_memory=False)
    with pytest.raises(ValueError, match="batch format"):
        batches.batch_format_of("arrow")


def test_batch_formats_are_rays():
    block = pa.table({"x": [1, 2]})
    assert isinstance(batches.to_format(block, batches.batch_format_of("default"))["x"], np.ndarray)
    assert isinstance(batches.to_format(block, "pandas"), pd.DataFrame)
    assert batches.to_format(block, None) is block


def test_device_auto_is_the_device_ray_elastic_torch_gives_the_worker():
    from ray_elastic.torch import get_device

    assert batches.worker_device() == get_device()
    assert batches.torch_batches(dtypes=None, device="auto", collate_fn=None, pin_memory=False).device == get_device()


# ---- the shard: keywords refused by name, drop_last, prefetch_batches ----------------------------------------


class _Answer:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self, *args):
        return self.answer(*args)


class _Feed:
    """A feed whose answers are the blocks themselves (`_get` passes them through): one epoch of `blocks`."""

    def __init__(self, blocks) -> None:
        entries = [((block, 0), len(block)) for block in blocks]
        self.blocks = _Answer(lambda name, epoch, start, wait: (entries[start:], True))
        self.ref = _Answer(lambda name, epoch, index, wait: entries[index][0])
        self.release = _Answer(lambda *args: None)


@pytest.fixture
def worker(monkeypatch):
    """The shard's worker: rank 0 of `world.size`, blocks fetched in place, prefetches recorded."""
    world = SimpleNamespace(rank=0, size=1, prefetched=[])
    slot = SimpleNamespace(joined=lambda: SimpleNamespace(slot=SimpleNamespace(rank=world.rank, size=world.size)))
    monkeypatch.setattr(shard_module, "current", lambda: slot)
    monkeypatch.setattr(shard_module, "_get", lambda value, timeout, what: value)
    monkeypatch.setattr(shard_module.ray, "wait", lambda refs, **kw: world.prefetched.append(refs))
    return world


def blocks_of(rows: int, per_block: int) -> list:
    return [pa.table({"id": np.arange(a, min(a + per_block, rows))}) for a in range(0, rows, per_block)]


@pytest.mark.parametrize("method", ["iter_batches", "iter_torch_batches"])
def test_what_a_lockstep_shard_cannot_honour_is_refused_by_name(method):
    iterate = getattr(DataShard("train", _Feed([])), method)
    with pytest.raises(ValueError, match="batch_size=None"):
        iterate(batch_size=None)
    with pytest.raises(ValueError, match="local_shuffle_buffer_size=64 cannot be honoured.*shuffle=True"):
        iterate(batch_size=8, local_shuffle_buffer_size=64)


def test_a_batch_across_blocks_is_one_batch_of_rays_format(worker):
    shard = DataShard("train", _Feed(blocks_of(10, 3)))
    got = list(shard.iter_batches(batch_size=4, batch_format="pyarrow"))
    assert [t["id"].to_pylist() for t in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(isinstance(t, pa.Table) for t in got)


def test_drop_last_drops_a_last_step_short_of_batch_size_as_ray_does_and_counts_its_rows(worker):
    worker.size = 2  # 10 rows, 2 ranks of 3: a full step of 6, then 4 rows, short of 3 per rank
    shard = DataShard("train", _Feed(blocks_of(10, 4)))
    got = [b["id"].tolist() for b in shard.iter_torch_batches(batch_size=3, drop_last=True)]
    assert got == [[0, 1, 2]] and shard.dropped_rows == 4 and shard.position == 10
    shard.set_epoch(1)
    got = [b["id"].tolist() for b in shard.iter_torch_batches(batch_size=3)]
    assert got == [[0, 1, 2], [6, 7]], "without it, the last step's rows split over the ranks"


def test_prefetch_batches_fetches_the_blocks_of_this_ranks_next_batches_and_zero_fetches_none(worker):
    shard = DataShard("train", _Feed(blocks_of(40, 4)))
    for _batch in shard.iter_batches(batch_size=4, prefetch_batches=0):
        pass
    assert worker.prefetched == []
    worker.rank, worker.size = 1, 2
    shard.set_epoch(1)
    it = shard.iter_batches(batch_size=4, prefetch_batches=2)
    assert next(it)["id"].tolist() == [4, 5, 6, 7]
    fetched = [int(block["id"][0].as_py()) for block in worker.prefetched[-1]]
    assert fetched == [12, 20], "rows 12-15 and 20-23: blocks 3 and 5, not the other rank's blocks 2 and 4"


def test_a_restored_position_hands_out_the_same_batches_again(worker):
    shard = DataShard("train", _Feed(blocks_of(12, 5)))
    it = shard.iter_torch_batches(batch_size=3)
    next(it)
    saved = shard.state_dict()
    after = [b["id"].tolist() for b in it]
    shard.load_state_dict(saved)
    again = [b["id"].tolist() for b in shard.iter_torch_batches(batch_size=3)]
    assert again == after == [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
