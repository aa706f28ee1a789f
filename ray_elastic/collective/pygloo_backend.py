"""The pygloo backend: Gloo without torch, for numpy-only workers.

A ring is one `pygloo.rendezvous.Context` connected (full mesh over TCP)
through the run's KV actor: `KVGlooStore` is the Python object with
`set/get/wait/del_keys` that `pygloo.rendezvous.CustomStore` calls into, and
every wait in it is bounded by the group's timeout. The ring is built again
for every generation. The group keeps Python references to the store, the
device and the context for its whole life: Gloo segfaults inside
`connectFullMesh` or later when a store it holds has been garbage-collected.

Values are numpy arrays, or torch CPU tensors, which are handed to Gloo by
their data pointers (torch itself is never imported here). Limits of pygloo
0.2.1: a collective's timeout is Gloo's fixed 30 s (its `setTimeout` cannot be
called from Python), and a collective holds the GIL while it blocks.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pygloo

from ray_elastic.collective.base import CollectiveGroup, ReduceOp, guarded_call

if TYPE_CHECKING:
    from ray_elastic.collective.address import GlooBinding
    from ray_elastic.rendezvous import KVClient

T = TypeVar("T")

GLOO_FIXED_TIMEOUT_S = 30.0

_DTYPES = {
    np.dtype(np.int8): pygloo.glooDataType_t.glooInt8,
    np.dtype(np.uint8): pygloo.glooDataType_t.glooUint8,
    np.dtype(np.int32): pygloo.glooDataType_t.glooInt32,
    np.dtype(np.uint32): pygloo.glooDataType_t.glooUint32,
    np.dtype(np.int64): pygloo.glooDataType_t.glooInt64,
    np.dtype(np.uint64): pygloo.glooDataType_t.glooUint64,
    np.dtype(np.float16): pygloo.glooDataType_t.glooFloat16,
    np.dtype(np.float32): pygloo.glooDataType_t.glooFloat32,
    np.dtype(np.float64): pygloo.glooDataType_t.glooFloat64,
}

_OPS = {
    ReduceOp.SUM: pygloo.ReduceOp.SUM,
    ReduceOp.AVERAGE: pygloo.ReduceOp.SUM,
    ReduceOp.MIN: pygloo.ReduceOp.MIN,
    ReduceOp.MAX: pygloo.ReduceOp.MAX,
}


class KVGlooStore:
    """The rendezvous store pygloo's `CustomStore` calls: one generation's keys in the KV actor."""

    def __init__(self, client: KVClient, generation: int, timeout: float) -> None:
        self._client = client
        self._generation = generation
        self._timeout_s = timeout

    def set(self, key: str, data: bytes) -> bool:
        self._client.set(self._generation, key, bytes(data))
        return True

    def get(self, key: str) -> bytes:
        return self._client.get(self._generation, key, self._timeout_s)

    def wait(self, keys: list[str]) -> bool:
        self._client.wait(self._generation, keys, self._timeout_s)
        return True

    def del_keys(self, keys: list[str]) -> bool:
        for key in keys:
            self._client.delete_key(self._generation, key)
        return True


def _device_attr(binding: GlooBinding) -> Any:
    """The TCP device's attributes: the user's interface where GLOO_SOCKET_IFNAME is set, else the node IP."""
    if binding.user_set:
        attr = pygloo.transport.tcp.attr()
        attr.iface = binding.interface
        return attr
    return pygloo.transport.tcp.attr(binding.ip)


def _view(value: Any) -> np.ndarray:
    """A numpy array sharing `value`'s memory (a numpy array, or a torch CPU tensor)."""
    if isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "data_ptr") and hasattr(value, "is_contiguous"):  # a torch tensor
        if value.device.type != "cpu":
            raise TypeError(f"the pygloo backend reduces CPU values only, got a tensor on {value.device}")
        if not value.is_contiguous():
            raise ValueError("torch tensors passed to collectives must be contiguous")
        try:
            array = value.detach().numpy()
        except TypeError as e:  # bfloat16 and other dtypes numpy has not
            raise TypeError(f"the pygloo backend does not reduce {value.dtype}") from e
    else:
        raise TypeError(f"collectives take numpy arrays or torch tensors, got {type(value).__name__}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("numpy arrays passed to collectives must be C-contiguous and writeable")
    if array.dtype not in _DTYPES:
        raise TypeError(f"the pygloo backend does not reduce {array.dtype}; supported: {sorted(map(str, _DTYPES))}")
    return array


def _like(result: np.ndarray, value: Any) -> Any:
    """`result` in the caller's type: a torch tensor for a tensor (sharing memory), else the array."""
    if isinstance(value, np.ndarray):
        return result
    import torch  # only reached with a torch tensor in hand, so torch is installed

    return torch.from_numpy(result)


class PyglooGroup(CollectiveGroup):
    """A full-mesh pygloo context for one generation, rendezvoused through the KV actor."""

    name = "pygloo"

    def __init__(
        self, kv: KVClient, generation: int, rank: int, size: int, timeout: float, binding: GlooBinding
    ) -> None:
        super().__init__(rank, size)
        # pygloo keeps raw pointers into these: they live exactly as long as the group
        self._py_store: KVGlooStore | None = KVGlooStore(kv, generation, timeout)
        self._store = pygloo.rendezvous.CustomStore(self._py_store)
        self._device = pygloo.transport.tcp.CreateDevice(_device_attr(binding))
        self._context = pygloo.rendezvous.Context(rank, size)
        self._call("connectFullMesh", lambda: self._context.connectFullMesh(self._store, self._device))
        self._int_buf = np.zeros(1, dtype=np.int64)

    _call = staticmethod(guarded_call)

    # ---- raw ops on numpy arrays ------------------------------------------------------
    def _allreduce(self, array: np.ndarray, op: Any) -> None:
        ptr = array.ctypes.data
        self._call(
            "allreduce",
            lambda: pygloo.allreduce(self._context, ptr, ptr, array.size, _DTYPES[array.dtype], op),
        )

    def _broadcast(self, array: np.ndarray, root_rank: int) -> None:
        ptr = array.ctypes.data
        self._call(
            "broadcast",
            lambda: pygloo.broadcast(self._context, ptr, ptr, array.size, _DTYPES[array.dtype], root_rank),
        )

    def _allgather_equal(self, array: np.ndarray) -> np.ndarray:
        """Every rank's `array` (same size everywhere), concatenated in rank order."""
        out = np.empty(array.size * self.size, dtype=array.dtype)
        if array.size:
            send, recv, dtype = array.ctypes.data, out.ctypes.data, _DTYPES[array.dtype]
            self._call("allgather", lambda: pygloo.allgather(self._context, send, recv, array.size, dtype))
        return out

    def _gather_counts(self, count: int) -> list[int]:
        self._int_buf[0] = count
        return self._allgather_equal(self._int_buf).tolist()

    # ---- the interface ----------------------------------------------------------------
    def allreduce_(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> T:
        array = _view(value)
        if array.size == 0 or self.size == 1:
            return value
        self._allreduce(array, _OPS[op])
        if op is ReduceOp.AVERAGE:
            if array.dtype.kind == "f":
                np.divide(array, self.size, out=array)
            else:
                np.floor_divide(array, self.size, out=array)
        return value

    def broadcast_(self, value: T, root_rank: int = 0) -> T:
        array = _view(value)
        if array.size == 0 or self.size == 1:
            return value
        self._broadcast(array, root_rank)
        return value

    def allgather(self, value: T) -> T:
        array = _view(value)
        rows = array.reshape(-1) if array.ndim == 0 else array
        if self.size == 1:
            return _like(rows.copy(), value)
        row_shape = rows.shape[1:]
        row = int(np.prod(row_shape, dtype=np.int64))
        counts = self._gather_counts(rows.shape[0])
        longest = max(counts)
        padded = np.zeros(longest * row, dtype=array.dtype)
        padded[: rows.size] = rows.reshape(-1)
        parts = self._allgather_equal(padded).reshape(self.size, longest * row)
        out = np.concatenate([parts[q, : n * row] for q, n in enumerate(counts)]).reshape(-1, *row_shape)
        return _like(out, value)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == root_rank else b""
        self._int_buf[0] = len(payload)
        self._broadcast(self._int_buf, root_rank)
        buf = np.frombuffer(payload, dtype=np.uint8).copy() if payload else np.empty(int(self._int_buf[0]), np.uint8)
        if buf.size:
            self._broadcast(buf, root_rank)
        return obj if self.rank == root_rank else pickle.loads(buf.tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        payload = pickle.dumps(obj)
        counts = self._gather_counts(len(payload))
        padded = np.zeros(max(counts), dtype=np.uint8)
        padded[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        parts = self._allgather_equal(padded).reshape(self.size, -1)
        return [pickle.loads(parts[q, :n].tobytes()) for q, n in enumerate(counts)]

    def barrier(self) -> None:
        if self.size > 1:
            self._call("barrier", lambda: pygloo.barrier(self._context))

    def max_int(self, value: int) -> int:
        if self.size == 1:
            return value
        self._int_buf[0] = value
        self._allreduce(self._int_buf, pygloo.ReduceOp.MAX)
        return int(self._int_buf[0])

    def close(self) -> None:
        context, self._context = self._context, None
        if context is not None:
            try:
                context.closeConnections()
            except Exception:  # noqa: BLE001 - a broken ring may fail to close; it is dropped either way
                pass
        # the context goes first, then what it pointed into
        del context
        self._store = self._py_store = self._device = None
