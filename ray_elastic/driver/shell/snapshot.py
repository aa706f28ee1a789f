"""The driver's write-ahead snapshot, in the GCS's key-value store, for a driver that Ray restarts.

After every batch of messages the driver applied, before it carries out the
batch's actions, it writes what it cannot rebuild from the workers: its
`DriverCore` (membership, generation, events, cool-downs), the reports
`fit()` has not fetched yet, and the last metrics batch taken from each
worker. The workers' calls are answered only once their message is in a
snapshot, so a call the dead driver took but did not save fails on the
caller's side and Ray sends it again to the restarted driver.

The GCS outlives both run actors (a driver and a KV actor that die together
lose nothing). Beside the snapshot lies what the driver starts from that
may be large (`save_start`: train_fn's payload, the discovery spec): as
constructor arguments Ray would keep them in the object store, owned by
`fit()`'s process, and a restart would hang on them once they are lost.
Both keys go with the run (`delete`, called by `fit()`'s clean-up and by
orphaned workers).

Any job on the cluster can write that key (the run id shows in its
namespaces' names), and a snapshot is a pickle: unpickling one that another
job wrote would run its code in the driver. So each snapshot carries an
HMAC under the run's secret (`RunToken.sign`), and `load` unpickles only a
snapshot whose signature verifies; any other is refused with
`ForgedSnapshotError`, unread. The start arguments are signed the same way.

A snapshot is written as what changed: its large parts (the roster's
columns, a plan's members: bytes the core keeps and reuses while they do
not change) lie under keys of their own (`driver/<run_id>/<name>`, each
signed), written once, and the snapshot names the parts it needs; a part
no snapshot names any more is deleted after the next write. So after a
death the GCS takes the core's small remainder and the rows that changed,
not every worker again.

A signature proves who wrote a snapshot, not when: an old snapshot of the
same run, written back, verifies too. So each snapshot also carries its
write counter, under the signature, and the driver confirms every counter
it wrote to the run's KV actor (`CallLedger`); a restarted driver refuses a
snapshot older than what the KV actor confirmed (`driver_actor._resume`).
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import cloudpickle

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ray_elastic.auth import RunToken

    Buffer = bytes | memoryview

_NAMESPACE = "ray_elastic"
_PURPOSE = "driver snapshot"
_SIGNATURE_BYTES = 32  # HMAC-SHA256


class StartError(RuntimeError):
    """What the driver starts from in the GCS cannot be used."""


class ForgedSnapshotError(StartError):
    """The snapshot (or start arguments) under the run's key is not signed with the run's secret: someone else
    wrote it."""


class StartMissingError(StartError):
    """The driver's start arguments are gone from the GCS: the run's clean-up removed them."""


def _key(run_id: str) -> str:
    return f"driver/{run_id}"


def _part_key(run_id: str, name: str) -> str:
    return f"driver/{run_id}/{name}"


def _start_key(run_id: str) -> str:
    return f"driver-start/{run_id}"


_COUNTER_BYTES = 8


def _put(key: str, blob: bytes, token: RunToken) -> None:
    signed = token.sign(f"{_PURPOSE}/{key}", blob) + blob
    ray_private.kv_put(key.encode(), signed, overwrite=True, namespace=_NAMESPACE)


def _get(key: str, token: RunToken, what: str) -> Any:
    blob = _verified(key, token, what)
    return None if blob is None else pickle.loads(blob)


def _verified(key: str, token: RunToken, what: str) -> bytes | None:
    """The signed bytes under `key`, or None if there are none; `ForgedSnapshotError` unless the run signed them."""
    stored = ray_private.kv_get(key.encode(), namespace=_NAMESPACE)
    if stored is None:
        return None
    signature, blob = stored[:_SIGNATURE_BYTES], stored[_SIGNATURE_BYTES:]
    if not token.signed(f"{_PURPOSE}/{key}", blob, signature):
        raise ForgedSnapshotError(
            f"{what} in the GCS (key {key}, {len(stored)} bytes) is not signed with this run's secret: another job "
            "on the cluster wrote it. It was refused unread, and the driver cannot go on without its own"
        )
    return blob


def save(
    run_id: str,
    counter: int,
    blob: bytes,
    token: RunToken,
    parts: Mapping[str, Buffer] | None = None,
    stale: Iterable[str] = (),
) -> None:
    """Store `blob` (a pickle), the run's `counter`-th snapshot, under the run's key, signed with its secret.

    `parts`, the large parts it names that no key holds yet, are written
    first, each under its own key; `stale`, parts no snapshot names any
    more, are deleted once the snapshot is written.
    """
    for name, part in (parts or {}).items():
        _put(_part_key(run_id, name), bytes(part), token)
    _put(_key(run_id), counter.to_bytes(_COUNTER_BYTES, "big") + blob, token)
    for name in stale:
        ray_private.kv_del(_part_key(run_id, name).encode(), namespace=_NAMESPACE)


def load_part(run_id: str, name: str, token: RunToken) -> bytes:
    """A part a snapshot names; `ForgedSnapshotError` unless the run signed it, `StartError` if it is gone."""
    part = _verified(_part_key(run_id, name), token, f"part {name} of the driver's snapshot")
    if part is None:
        raise StartError(f"part {name} of the driver's snapshot is not in the GCS (key {_part_key(run_id, name)})")
    return part


def load(run_id: str, token: RunToken) -> tuple[int, Any] | None:
    """(its write counter, the unpickled snapshot), or None if there is none.

    `ForgedSnapshotError` if its signature does not verify.
    """
    stored = _verified(_key(run_id), token, "the driver's snapshot")
    if stored is None:
        return None
    return int.from_bytes(stored[:_COUNTER_BYTES], "big"), pickle.loads(stored[_COUNTER_BYTES:])


def save_start(run_id: str, token: RunToken, payload: bytes, discovery: Any) -> None:
    """What the run's driver starts from, every time Ray starts it: train_fn's payload and the discovery spec."""
    _put(_start_key(run_id), cloudpickle.dumps((payload, discovery)), token)


def load_start(run_id: str, token: RunToken) -> tuple[bytes, Any]:
    """`save_start`'s arguments; `ForgedSnapshotError` if they are not the run's, `StartMissingError` if gone."""
    start = _get(_start_key(run_id), token, "the driver's start arguments")
    if start is None:
        raise StartMissingError(
            f"the driver's start arguments are not in the GCS (key {_start_key(run_id)}): the run ended"
        )
    return start


def delete(run_id: str) -> None:
    parts = ray_private.kv_list(_part_key(run_id, ""), namespace=_NAMESPACE)
    for key in [_key(run_id).encode(), _start_key(run_id).encode(), *parts]:
        ray_private.kv_del(key, namespace=_NAMESPACE)
