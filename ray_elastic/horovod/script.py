"""A whole Python script as a worker's training function, as `horovodrun` runs it in every process.

`ScriptRun(path, source, args, cwd)` is what `ray-elastic run SCRIPT.py`
hands to `ElasticTrainer` as `train_fn`. In each worker actor it runs the
script's source (shipped from the launcher, so the workers need not see the
file) as `__main__`, with `sys.argv = [path, *args]`, in the launcher's
working directory and with the script's directory first on `sys.path` where
those exist on the worker's machine. The script's top level calls
`hvd.init()` and its `@hvd.elastic.run` function; a newcomer runs it from
the top and receives the state at the sync, as in Horovod.

While the script runs, its `sys.stdout` and `sys.stderr` prefix every line
with the worker's current rank, `[RANK]<stdout>:` and `[RANK]<stderr>:`
(`[?]` before it joins), as horovodrun's Gloo launcher does; the launcher
prints those lines as they are (see `WorkerLinePrinter`). Ray forwards a
worker's output to the launcher asynchronously (its log monitor tails the
worker's files), so when the script ends each worker writes one
`END_OF_OUTPUT` line to its stdout and its stderr: the launcher waits for
those of every worker that finished before it exits, so the last lines a
script printed are never cut off.

`sys.exit(0)` (or `sys.exit()`) ends the script normally; another status is
the script's failure. A script that ends without having joined the ring (no
`hvd.init()`) is an error that says so.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import linecache
import os
import re
import sys
import threading
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ray_elastic.runtime import maybe_current

if TYPE_CHECKING:
    from collections.abc import Iterator

# a line printed by a script's worker, as `RankPrefixedStream` writes it
LINE_PREFIX = re.compile(r"^\[(\d+|\?)\]<(stdout|stderr)>:")
# a worker's last line on each of its streams once its script has ended; the launcher does not print it
END_OF_OUTPUT = "ray-elastic: end of the script's output"


class ScriptExitError(RuntimeError):
    """The script called `sys.exit()` with a status other than 0."""


@dataclass(frozen=True)
class ScriptRun:
    """A script to run whole in every worker: `ScriptRun(path, source, args, cwd)(config)`.

    Args:
        path: the script's absolute path on the launcher's machine (`__file__`,
            `sys.argv[0]`, tracebacks).
        source: its text, compiled in the worker.
        args: the script's command-line arguments (`sys.argv[1:]`).
        cwd: the launcher's working directory, used where it exists.
    """

    path: str
    source: str
    args: tuple[str, ...] = ()
    cwd: str = ""

    def __call__(self, config: dict[str, Any]) -> None:
        with rank_prefixed_output():
            self._execute()
        ctx = maybe_current()
        if ctx is not None and ctx.slot is None:
            raise RuntimeError(
                f"{self.path} finished without joining the ring: call hvd.init() at its top level "
                "(import ray_elastic.horovod.torch as hvd)"
            )

    def _execute(self) -> None:
        if self.cwd and os.path.isdir(self.cwd):
            os.chdir(self.cwd)
        script_dir = os.path.dirname(self.path)
        if os.path.isdir(script_dir) and script_dir not in sys.path:
            sys.path.insert(0, script_dir)  # as `python SCRIPT.py` does: sibling modules import
        # tracebacks show the script's lines even where the file is not on this machine
        linecache.cache[self.path] = (len(self.source), None, self.source.splitlines(True), self.path)
        code = compile(self.source, self.path, "exec")
        main = types.ModuleType("__main__")
        main.__file__ = self.path
        setattr(main, "__builtins__", builtins)  # noqa: B010 - a module's attribute mypy does not know
        saved_main, saved_argv = sys.modules.get("__main__"), sys.argv
        # objects of classes the script defines pickle as __main__.X and unpickle on every rank
        sys.modules["__main__"] = main
        sys.argv = [self.path, *self.args]
        try:
            exec(code, main.__dict__)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ScriptExitError(f"{self.path} called sys.exit({e.code!r})") from None
        finally:
            sys.argv = saved_argv
            if saved_main is not None:
                sys.modules["__main__"] = saved_main


class RankPrefixedStream(io.TextIOBase):
    """A text stream that writes each complete line as `[RANK]<NAME>:line` to `target`, flushed."""

    def __init__(self, target: TextIO, name: str) -> None:
        super().__init__()
        self.target = target
        self.name = name
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._pending + text).split("\n")
            self._pending = lines.pop()
            if lines:
                prefix = f"[{_rank_text()}]<{self.name}>:"
                self.target.write("".join(f"{prefix}{line}\n" for line in lines))
                self.target.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self.target.write(f"[{_rank_text()}]<{self.name}>:{self._pending}\n")
                self._pending = ""
            self.target.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.target.fileno()


def _rank_text() -> str:
    ctx = maybe_current()
    slot = ctx.slot if ctx is not None else None
    return "?" if slot is None else str(slot.rank)


@contextlib.contextmanager
def rank_prefixed_output() -> Iterator[None]:
    """Route `sys.stdout` and `sys.stderr` through `RankPrefixedStream`s while the block runs.

    A block that ran to its end writes `END_OF_OUTPUT` on both streams. One
    that raised (a worker that left the run: its host removed, or the run
    failing) writes none: the launcher waits for the ends of the workers that
    finished, and a worker that left earlier must not stand in for one of them.
    """
    saved = sys.stdout, sys.stderr
    sys.stdout = RankPrefixedStream(saved[0], "stdout")
    sys.stderr = RankPrefixedStream(saved[1], "stderr")
    finished = False
    try:
        yield
        finished = True
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
        for original in saved:
            if finished:
                original.write(END_OF_OUTPUT + "\n")
            original.flush()


class WorkerLinePrinter:
    """Prints the worker output Ray forwards to the launcher: the scripts' lines as they are.

    Called with each batch Ray's log subscriber hands over (from its thread).
    A line of a script (`[RANK]<stdout>:...`) is printed unchanged, to stdout
    or stderr as the worker wrote it; any other line (Ray's own, the
    library's actors') keeps a short `(NAME pid=PID)` prefix; the autoscaler's
    status reports are left out. `END_OF_OUTPUT` lines are counted, not
    printed: `wait_for_ends` waits on them.
    """

    def __init__(self) -> None:
        self._ended: dict[bool, set[Any]] = {False: set(), True: set()}  # is_err -> pids whose script ended
        self._changed = threading.Condition()

    def __call__(self, data: dict[str, Any]) -> None:
        if data.get("pid") == "autoscaler":
            return  # its status reports are not the job's output (Ray's own printer filters them too)
        is_err = bool(data.get("is_err"))
        sink = sys.stderr if is_err else sys.stdout
        who = data.get("actor_name") or data.get("task_name") or "ray"
        out = []
        ended = False
        for line in data.get("lines", []):
            if line == END_OF_OUTPUT:
                ended = True
            else:
                out.append(line if LINE_PREFIX.match(line) else f"({who} pid={data.get('pid')}) {line}")
        if out:
            sink.write("\n".join(out) + "\n")
            sink.flush()
        if ended:
            with self._changed:
                self._ended[is_err].add(data.get("pid"))
                self._changed.notify_all()

    def wait_for_ends(self, workers: int, timeout: float) -> int:
        """Wait until `workers` workers' stdout and stderr have both ended, at most `timeout` s.

        Returns how many of those streams had not ended by then (0: every line arrived).
        """

        def missing() -> int:
            return sum(max(0, workers - len(pids)) for pids in self._ended.values())

        with self._changed:
            self._changed.wait_for(lambda: missing() == 0, timeout)
            return missing()
