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

Any job on the cluster can write that key (the run id shows in its
namespaces' names), and a snapshot is a pickle: unpickling one that another
job wrote would run its code in the driver. So each snapshot carries an
HMAC under the run's secret (`RunToken.sign`), and `load` unpickles only a
snapshot whose signature verifies; any other is refused with
`ForgedSnapshotError`, unread.
"""

from __future__ import annotations

import pickle
from typing import Any

from ray.experimental import internal_kv

from ray_elastic.auth import RunToken

_NAMESPACE = "ray_elastic"
_PURPOSE = "driver snapshot"
_SIGNATURE_BYTES = 32  # HMAC-SHA256


class ForgedSnapshotError(RuntimeError):
    """The snapshot under the run's key is not signed with the run's secret: someone else wrote it."""


def _key(run_id: str) -> bytes:
    return f"driver/{run_id}".encode()


def save(run_id: str, blob: bytes, token: RunToken) -> None:
    """Store `blob` (a pickle) under the run's key, signed with the run's secret."""
    signed = token.sign(f"{_PURPOSE}/{run_id}", blob) + blob
    internal_kv._internal_kv_put(_key(run_id), signed, overwrite=True, namespace=_NAMESPACE)


def load(run_id: str, token: RunToken) -> Any:
    """The unpickled snapshot, or None if there is none; `ForgedSnapshotError` if its signature does not verify."""
    stored = internal_kv._internal_kv_get(_key(run_id), namespace=_NAMESPACE)
    if stored is None:
        return None
    signature, blob = stored[:_SIGNATURE_BYTES], stored[_SIGNATURE_BYTES:]
    if not token.signed(f"{_PURPOSE}/{run_id}", blob, signature):
        raise ForgedSnapshotError(
            f"the driver's snapshot in the GCS (key driver/{run_id}, {len(stored)} bytes) is not signed with this "
            "run's secret: another job on the cluster wrote it. It was refused unread, and the restarted driver "
            "cannot resume without its own snapshot"
        )
    return pickle.loads(blob)


def delete(run_id: str) -> None:
    internal_kv._internal_kv_del(_key(run_id), namespace=_NAMESPACE)
