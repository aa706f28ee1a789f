"""What `fit()` ships to the driver and the workers: the user's objects, pickled.

cloudpickle pickles a function or class by reference (module and name) when
its module is importable, and by value otherwise. The workers can import
installed packages, and the modules under the directories Ray puts on their
path (the driver script's directory and the working directory, as Ray's own
job config lists them). Every other module of the user's (a test helper, a
file imported from elsewhere) travels by value. A class that the workers can
import therefore arrives as the same class (`isinstance` and `torch.save`
work), not as a copy.

Should the workers still fail to import a module Ray's path promised
(another machine laid out differently), `unpack` falls back to a second
copy pickled wholly by value; that copy is made only when some user module
went by reference.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

import cloudpickle

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Iterable

_TAG = "ray-elastic-payload-1"
# cloudpickle's by-value registry is process-wide: two threads packing at once must not interleave
_LOCK = threading.Lock()


def pack(obj: Any) -> bytes:
    """Pickle `obj` for the workers: user modules they can import by reference, the others by value."""
    loose = _user_modules()
    roots = worker_import_roots()
    by_value = [m for m in loose if not importable_from(m, roots)]
    with _LOCK:
        primary = _dumps(obj, by_value)
        fallback = _dumps(obj, loose) if len(by_value) < len(loose) else None
    return cloudpickle.dumps((_TAG, primary, fallback))


def unpack(data: bytes) -> Any:
    """The object `pack` pickled; a module that will not import here takes the by-value copy."""
    tag, primary, fallback = cloudpickle.loads(data)
    if tag != _TAG:
        raise ValueError(f"not a ray-elastic payload (tag {tag!r})")
    try:
        return cloudpickle.loads(primary)
    except ImportError:
        if fallback is None:
            raise
        return cloudpickle.loads(fallback)


def importable_from(module: ModuleType, roots: Iterable[str]) -> bool:
    """Whether `module` is the file its name resolves to under one of `roots`."""
    path = os.path.abspath(module.__file__ or "")
    relative = module.__name__.replace(".", os.sep)
    for root in roots:
        base = os.path.join(os.path.abspath(root), relative)
        if path in (base + ".py", os.path.join(base, "__init__.py")):
            return True
    return False


def worker_import_roots() -> list[str]:
    """The directories Ray adds to the workers' path: the job's driver paths, else the working directory."""
    try:
        job_config = ray_private.job_config()
        roots = list(job_config.py_driver_sys_path)
    except Exception:  # noqa: BLE001 - not connected yet, or Ray's private API moved: Ray's documented default
        roots = []
    return roots or [os.getcwd()]


def _user_modules() -> list[ModuleType]:
    """Modules loaded from files outside the installed packages and the standard library (and not ours).

    `sys.modules` may hold objects that are not modules (a package can put
    any object there: one seen beside Lightning on a GPU machine had no
    `__name__`); they are not the user's modules, and skipped.
    """
    paths = sysconfig.get_paths()
    installed = tuple({os.path.abspath(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib")})
    return [
        module
        for name, module in list(sys.modules.items())
        if name != "__main__"
        and isinstance(module, ModuleType)
        and getattr(module, "__name__", None) == name
        and not name.startswith("ray_elastic")
        and isinstance(getattr(module, "__file__", None), str)
        and not os.path.abspath(module.__file__ or "").startswith(installed)
    ]


def _dumps(obj: Any, by_value: list[ModuleType]) -> bytes:
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)
