"""Which checkpoint is the newest, and who may write one: the store and its writer, without Ray.

- The newest checkpoint is the newest (generation, commit) its
  `ray_elastic.json` names, whatever order the writes landed in; a new
  `fit()` that resumed from a run's checkpoint writes newer ones, although
  its generations count from 1 again.
- A writer whose generation was superseded writes nothing: not on a retry
  after back-off, not when it is superseded while its files are written
  (the manifest is the last thing checked for).
- Two writers never share a directory, even on storage where creating a
  directory is no claim on it (object stores); a writer never removes a
  checkpoint another writer is still writing, when that one is newer.
- A manifest that exists but fails to read (a storage timeout, a refused
  permission) is not a torn checkpoint: pruning keeps it, and while it may
  be the newest no older checkpoint is read in its place.

Each runs on local disk and on fsspec's `memory://`, and on a filesystem
whose directories exist only through their files, as on S3.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from test_checkpoint import FlakyStore

from ray_elastic.checkpoint import META_FILE, CheckpointError, CheckpointStore, CheckpointWriter


class ObjectStoreLike(MemoryFileSystem):
    """In memory, with S3's directories: `makedirs` creates nothing, a directory is seen once a file is in it."""

    protocol = "objmem"
    root_marker = ""

    def makedirs(self, path, exist_ok=False):
        pass

    def mkdir(self, path, create_parents=True, **kwargs):
        pass


fsspec.register_implementation("objmem", ObjectStoreLike, clobber=True)


@pytest.fixture(params=["local", "memory", "objmem"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    url = f"{request.param}://store-{uuid.uuid4().hex[:8]}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


class Hook:
    """An entry whose pickling runs `action`: the moment a write is half-way through its files."""

    def __init__(self, action) -> None:
        self.action = action

    def __reduce__(self):
        self.action()
        return (int, (7,))


def test_the_latest_is_the_newest_generation_and_commit_not_the_last_written(root):
    store = CheckpointStore(root, keep=3)
    store.write({"who": "new rank 0"}, {"generation": 4, "commit": 101})
    # a rank 0 of generation 3, cut off and further along in its dead timeline, lands its write afterwards
    store.write({"who": "stale rank 0"}, {"generation": 3, "commit": 120})
    assert store.read()[0] == {"who": "new rank 0"}
    assert store.meta()["generation"] == 4
    assert [CheckpointStore(root).read(p)[1]["commit"] for p in store.checkpoints()] == [120, 101]


def test_a_new_fit_that_resumed_writes_checkpoints_newer_than_the_run_it_resumed(root):
    store = CheckpointStore(root, keep=2)
    store.write({"step": 100}, {"run": "first", "generation": 7, "commit": 100})
    # the next fit() resumed from that one: its generations count from 1 again, its commits go on
    store.write({"step": 110}, {"run": "second", "generation": 1, "commit": 110})
    assert store.read()[0] == {"step": 110}
    store.write({"step": 120}, {"run": "second", "generation": 2, "commit": 120})
    assert [store.read(p)[0]["step"] for p in store.checkpoints()] == [110, 120]


def test_two_writers_never_share_a_directory(root):
    store = CheckpointStore(root, keep=5)
    other = CheckpointStore(root, keep=5)
    # the other writer lists the directory and writes while this one's first file is still being written
    store.write(
        {"x": Hook(lambda: other.write({"x": 2}, {"generation": 2, "commit": 9})), "y": 1},
        {"generation": 2, "commit": 9},
    )
    contents = sorted(store.read(p, allow_pickle=True)[0]["x"] for p in store.checkpoints())
    assert contents == [2, 7], "each write is whole in a directory of its own"
    assert len({p.rsplit("/", 1)[-1] for p in store.checkpoints()}) == 2


def test_pruning_never_removes_a_newer_checkpoint_another_writer_is_still_writing(root):
    new = CheckpointStore(root, keep=1)
    stale = CheckpointStore(root, keep=1)
    stale.write({"x": 0}, {"generation": 3, "commit": 90})
    # the new rank 0 is writing generation 4's checkpoint when the stale one's write lands and prunes
    new.write(
        {"x": Hook(lambda: stale.write({"x": 1}, {"generation": 3, "commit": 95}))}, {"generation": 4, "commit": 100}
    )
    assert new.read(allow_pickle=True)[0] == {"x": 7}
    assert new.meta()["commit"] == 100
    assert len(new.checkpoints()) == 1, "the stale ones went at the next write"


def test_a_torn_write_older_than_the_newest_is_removed_a_newer_one_is_left(root):
    store = CheckpointStore(root, keep=1)
    fs = store.fs

    class Dies(Exception):
        pass

    def die():
        raise Dies

    for generation in (2, 9):  # the process dies mid-write: its files so far stay, no manifest
        original = CheckpointStore._remove
        CheckpointStore._remove = lambda self, path: None
        try:
            with pytest.raises(Dies):
                store.write({"a": 1, "b": Hook(die)}, {"generation": generation, "commit": 1})
        finally:
            CheckpointStore._remove = original
    store.write({"a": 5}, {"generation": 5, "commit": 1})
    left = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(store.root, detail=False))
    assert len(left) == 2 and "-g000005-" in left[0] and "-g000009-" in left[1], left
    assert store.read()[0] == {"a": 5}


def test_a_writer_superseded_during_its_back_off_does_not_write_on_the_retry(root):
    store = FlakyStore(root, failures=1)
    current = {"generation": 3}

    def fence(meta):
        return None if meta["generation"] >= current["generation"] else "superseded"

    writer = CheckpointWriter(store, attempts=3, backoff_s=0.01, fence=fence)
    original = store.write

    def write_then_supersede(entries, meta, fence=None):
        try:
            return original(entries, meta, fence=fence)
        finally:
            current["generation"] = 4  # the run moved on while this writer backed off

    store.write = write_then_supersede
    writer.submit({"x": 1}, {"generation": 3, "commit": 10}, timeout=10)
    note = writer.flush(timeout=10)
    assert note is not None and "superseded" in note
    assert CheckpointStore(root).latest() is None and writer.written == 0


def test_a_writer_superseded_while_writing_its_files_writes_no_manifest(root):
    current = {"generation": 3}

    def fence(meta):
        return None if meta["generation"] >= current["generation"] else "superseded by generation 4"

    def supersede():
        current["generation"] = 4

    store = CheckpointStore(root)
    writer = CheckpointWriter(store, attempts=3, backoff_s=0.01, fence=fence)
    writer.submit({"x": Hook(supersede)}, {"generation": 3, "commit": 10}, timeout=10)
    note = writer.flush(timeout=10)
    assert note is not None and "superseded by generation 4" in note
    assert CheckpointStore(root).latest() is None and writer.written == 0
    fs = store.fs
    assert not fs.exists(store.root) or not [p for p in fs.ls(store.root, detail=False) if "checkpoint_" in p]


def unreadable_manifest(monkeypatch, store: CheckpointStore, path: str, error: Exception) -> None:
    """Reading the manifest of the checkpoint at `path` fails with `error`, as storage that times out would."""
    opened = store.fs.open
    manifest = f"{path}/{META_FILE}"

    def open_(name, *args, **kwargs):
        if name.rstrip("/").endswith(manifest.lstrip("/")) and "r" in (args[0] if args else kwargs.get("mode", "rb")):
            raise error
        return opened(name, *args, **kwargs)

    monkeypatch.setattr(store.fs, "open", open_)


@pytest.mark.parametrize("error", [TimeoutError("read timed out"), PermissionError(13, "Permission denied")])
def test_pruning_keeps_a_checkpoint_whose_manifest_fails_to_read(root, monkeypatch, error):
    store = CheckpointStore(root, keep=2)
    store.write({"step": 10}, {"generation": 1, "commit": 10})
    intact = store.write({"step": 20}, {"generation": 1, "commit": 20})
    unreadable_manifest(monkeypatch, store, intact, error)
    store.write({"step": 30}, {"generation": 1, "commit": 30})  # prunes while commit 20's manifest cannot be read
    monkeypatch.undo()
    assert [store.read(p)[0]["step"] for p in store.checkpoints()] == [10, 20, 30], "commit 20 was never torn"
    store.write({"step": 40}, {"generation": 1, "commit": 40})  # readable again: the newest 2 are kept
    assert [store.read(p)[0]["step"] for p in store.checkpoints()] == [30, 40]


def test_a_resume_never_reads_an_older_checkpoint_while_the_newest_manifest_fails_to_read(root, monkeypatch):
    store = CheckpointStore(root, keep=2)
    store.write({"step": 10}, {"generation": 1, "commit": 10})
    newest = store.write({"step": 20}, {"generation": 1, "commit": 20})
    unreadable_manifest(monkeypatch, store, newest, TimeoutError("read timed out"))
    with pytest.raises(CheckpointError, match=r"may be, and its ray_elastic.json cannot be read \(TimeoutError"):
        store.read()
    with pytest.raises(CheckpointError, match=newest.rsplit("/", 1)[-1]):
        store.exists()  # the driver's look asks again, then reports a storage error, never "no checkpoint"
    monkeypatch.undo()
    assert store.read()[0] == {"step": 20}


def test_an_older_checkpoint_whose_manifest_fails_to_read_does_not_stop_a_resume(root, monkeypatch):
    store = CheckpointStore(root, keep=2)
    older = store.write({"step": 10}, {"generation": 1, "commit": 10})
    store.write({"step": 20}, {"generation": 1, "commit": 20})
    unreadable_manifest(monkeypatch, store, older, PermissionError(13, "Permission denied"))
    assert store.read()[0] == {"step": 20}


def test_a_missing_manifest_is_still_torn_and_removed(root):
    store = CheckpointStore(root, keep=2)
    first = store.write({"step": 10}, {"generation": 1, "commit": 10})
    store.fs.rm(f"{first}/{META_FILE}")  # what a write cut short before its manifest leaves
    store.write({"step": 20}, {"generation": 1, "commit": 20})
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False)]
    assert first.rsplit("/", 1)[-1] not in names
