"""The driver's write-ahead snapshot, in the GCS's key-value store, for a driver that Ray restarts.

After every batch of messages the driver applied, before it carries out the
batch's actions, it writes what it cannot rebuild from the workers: its
`DriverCore` (membership, generation, events, cool-downs), the reports
`fit()` has not fetched yet, and the last metrics batch taken from each
worker. The workers' calls are answered only once their message is in a
snapshot, so a call the dead driver took but did not save fails on the
caller's side and Ray sends it again to the restarted driver.

The GCS outlives both run actors (a driver and a KV actor that die together
lose nothing). The key goes with the run (`delete`, called by `fit()`'s
clean-up and by orphaned workers).
"""

from __future__ import annotations

import pickle
from typing import Any

from ray.experimental import internal_kv

_NAMESPACE = "ray_elastic"


def _key(run_id: str) -> bytes:
    return f"driver/{run_id}".encode()


def save(run_id: str, blob: bytes) -> None:
    internal_kv._internal_kv_put(_key(run_id), blob, overwrite=True, namespace=_NAMESPACE)


def load(run_id: str) -> Any:
    """The unpickled snapshot, or None if there is none."""
    blob = internal_kv._internal_kv_get(_key(run_id), namespace=_NAMESPACE)
    return None if blob is None else pickle.loads(blob)


def delete(run_id: str) -> None:
    internal_kv._internal_kv_del(_key(run_id), namespace=_NAMESPACE)
