"""Durable checkpoints: the committed state on disk or in object storage, in files users can open.

`ElasticTrainer(checkpoint_dir=..., checkpoint_every=K, checkpoint_keep=N)`
makes rank 0 write its committed state every K commits, keeping the newest
N, so a run survives what in-memory commits cannot: every worker lost at
once, or the whole cluster gone. A new `fit()` (or the driver, after losing
every worker) starts fresh workers, and the one that becomes rank 0 loads
the latest checkpoint before the first sync broadcasts it to the others.

The parts: `store.py` (the directory of checkpoints, newest by their manifests, each whole
before it counts), `files.py` (one checkpoint as plain files: `.pt` for
`torch.load`, JSON, pickles), `entries.py` (a state's commit as plain entries,
and back; `torch/checkpoint_form.py` registers state dicts for torch objects),
`writer.py` (rank 0's background writer), `opening.py` (`load_checkpoint`
for users), `bounded.py` (storage calls with a deadline), `pins.py` (keeping a
checkpoint from pruning while it is copied).
"""

from ray_elastic.checkpoint.bounded import CheckpointError, bounded_call
from ray_elastic.checkpoint.opening import load_checkpoint
from ray_elastic.checkpoint.store import META_FILE, CheckpointStore, normalize_url, order_key
from ray_elastic.checkpoint.writer import CheckpointWriter

__all__ = [
    "META_FILE",
    "bounded_call",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriter",
    "load_checkpoint",
    "normalize_url",
    "order_key",
]
