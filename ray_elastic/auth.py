"""A run's secret token: its actors answer only the calls that carry it.

Ray has no per-job authentication: any job connected to the cluster can
list a run's named actors (`ray.util.list_named_actors(all_namespaces=True)`)
and call them, i.e. read its metrics, inject metrics into `Result.metrics_history`,
publish a generation on its KV actor or tell its workers to leave. So
`fit()` draws a random token per run (`RunToken`, 128 bits, never printed
or logged), hands it to the run's actors when it creates them, and every
method those actors expose takes it as its first argument
(`with_token_check`) and refuses a call without it with `PermissionError`.
Callers hold `Authed` handles, which add it to each call.

This keeps other jobs from disturbing a run by accident or by casual
intent; it is not a security boundary against someone who can read the
processes' memory or Ray's object store on the cluster's machines.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import logging
import secrets
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class RunToken:
    """A run's secret: compared in constant time, hidden from `repr` and logs."""

    __slots__ = ("value",)

    def __init__(self, value: str | None = None) -> None:
        self.value = value if value is not None else secrets.token_hex(16)

    def admits(self, presented: object) -> bool:
        return isinstance(presented, str) and hmac.compare_digest(presented, self.value)

    def sign(self, purpose: str, data: bytes) -> bytes:
        """An HMAC-SHA256 of `data` under this run's secret; `purpose` keeps a signature for one use from passing
        for another's."""
        return hmac.new(self.value.encode(), purpose.encode() + b"\0" + data, hashlib.sha256).digest()

    def signed(self, purpose: str, data: bytes, signature: bytes) -> bool:
        """Whether `signature` is this run's `sign(purpose, data)` (compared in constant time)."""
        return hmac.compare_digest(self.sign(purpose, data), signature)

    def __repr__(self) -> str:
        return "RunToken(<hidden>)"

    __str__ = __repr__


class Authed:
    """An actor handle whose method calls carry the run's token: `authed.method.remote(*args)`."""

    def __init__(self, handle: Any, token: RunToken) -> None:
        self.handle = handle
        self._token = token

    def __getattr__(self, name: str) -> _AuthedMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _AuthedMethod(getattr(self.handle, name), self._token)

    def __repr__(self) -> str:
        return f"Authed({self.handle!r})"


class _AuthedMethod:
    def __init__(self, method: Any, token: RunToken) -> None:
        self._method = method
        self._token = token

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(self._token.value, *args, **kwargs)


def _refuse(cls_name: str, method: str) -> PermissionError:
    logger.warning("%s refused a call to %s without this run's token", cls_name, method)
    return PermissionError(
        f"{cls_name}.{method} refused a call without this run's token: only the run's own "
        "fit() and its actors may call it"
    )


def _checked(fn: Callable[..., Any], cls_name: str) -> Callable[..., Any]:
    name = fn.__name__
    checked: Callable[..., Any]
    if inspect.iscoroutinefunction(fn):

        async def checked_async(self: Any, token: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._run_token.admits(token):
                raise _refuse(cls_name, name)
            return await fn(self, *args, **kwargs)

        checked = checked_async
    else:

        def checked_sync(self: Any, token: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._run_token.admits(token):
                raise _refuse(cls_name, name)
            return fn(self, *args, **kwargs)

        checked = checked_sync
    checked.__name__ = checked.__qualname__ = name
    checked.__doc__ = fn.__doc__
    checked.__dict__.update(fn.__dict__)  # Ray's per-method options (concurrency group, num_returns)
    return checked


def with_token_check(cls: type[object], exempt: Iterable[str] = ()) -> type:
    """`cls` with every public method taking the run's token first, and refusing calls without it.

    The subclass's constructor takes the `RunToken` first, then `cls`'s
    arguments. `exempt` names public methods the object calls on itself.
    """
    skip = set(exempt)
    methods = {
        name: _checked(fn, cls.__name__)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in skip
    }
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, token: RunToken, *args: Any, **kwargs: Any) -> None:
        self._run_token = token
        original_init(self, *args, **kwargs)

    # Ray reads the signature: hide the wrapped one, which lacks the token
    del __init__.__wrapped__
    methods["__init__"] = __init__
    return type(cls.__name__, (cls,), methods)
