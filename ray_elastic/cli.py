"""`ray-elastic run`: an `ElasticTrainer` from the command line, and the counterpart of `horovodrun`.

Two forms:

- `ray-elastic run FILE.py:FUNCTION --min-workers N ...` loads the training
  function from a file (or a module) and calls `FUNCTION(config)` in every
  worker.
- `ray-elastic run SCRIPT.py -np N [--min-np N --max-np N ...] -- ARGS` runs
  a Horovod-style script whole in every worker, as `horovodrun` does (see
  `ray_elastic.horovod`): `horovodrun`'s elastic options are accepted
  (`-np`, `--min-np`, `--max-np`, `--host-discovery-script`,
  `--slots-per-host`, `--reset-limit`, `--blacklist-cooldown-range`,
  `--elastic-timeout`), and every line the workers print comes out prefixed
  by its rank, `[RANK]<stdout>:`.

Either way it builds an `ElasticTrainer` from the options, connects to a Ray
cluster (or starts a local one), trains, and prints a summary: the
membership events, and for a function rank 0's last metrics and its return
value. Every argument is checked (a script is compiled) before anything is
spawned; bad input exits with status 2 and says what is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import reprlib
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# how long the launcher waits, after a script's run, for the last lines its workers printed
OUTPUT_TIMEOUT_S = 10.0

EXAMPLES = """\
examples:
  ray-elastic run examples/digits.py:train_fn --min-workers 2 --max-workers 4
  ray-elastic run train.py -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh -- --epochs 5
  ray-elastic run examples/digits.py:train_fn --min-workers 2 --max-workers 8 \\
      --discovery-script ./discover.sh --config epochs=5 lr=0.05 --address 10.0.0.1:6379
  ray-elastic run mypkg.train:main --min-workers 1 --max-workers 4 --resources-per-worker CPU=4

the function is called as FUNCTION(config) in every worker, config being the
dict built from --config. A discovery script prints one 'host' or 'host:slots'
line per host that may run workers (hosts: Ray node IDs or unique IPs), as
Horovod's --host-discovery-script does; it is run again every
--discovery-interval seconds, so hosts can come and go.

SCRIPT.py (no :FUNCTION) is a Horovod-style script run whole in every worker,
with the arguments after -- as its own; import ray_elastic.horovod.torch as hvd
is its one changed line. -np N with no --min-np/--max-np runs between N and N
workers; training starts once --min-np are ready and grows to --max-np as
discovery offers slots.
"""


def _key_value(text: str) -> tuple[str, Any]:
    """`key=value`, the value parsed as JSON where it parses (numbers, true, lists), else kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        hint = " (FILE.py:FUNCTION goes before the options)" if ":" in text and not sep else ""
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}{hint}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _resources(text: str) -> list[tuple[str, float]]:
    """`CPU=1,GPU=0.5` as (name, amount) pairs."""
    pairs = []
    for item in text.split(","):
        name, sep, amount = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            pairs.append((name.strip(), float(amount)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT[,NAME=AMOUNT...], got {text!r}") from None
    return pairs


def _target(text: str) -> str:
    if is_script(text):
        return text
    path, sep, function = text.rpartition(":")
    if not sep or not path or not function.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FILE.py:FUNCTION, MODULE:FUNCTION or SCRIPT.py, got {text!r}")
    return text


def is_script(target: str) -> bool:
    """Whether `target` names a whole script (`train.py`) rather than a function (`train.py:main`)."""
    return target.endswith(".py")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-elastic",
        description="Elastic, fault-tolerant data-parallel training on Ray, with Horovod Elastic's semantics.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="train FUNCTION(config), or run a Horovod-style SCRIPT.py, on elastic Ray workers",
        usage="ray-elastic run FILE.py:FUNCTION --min-workers N [--max-workers N] [options]\n"
        "       ray-elastic run SCRIPT.py -np N [--min-np N] [--max-np N] [options] [-- SCRIPT_ARGS]",
        description="Train FUNCTION(config), or run SCRIPT.py whole as horovodrun does, on between\n"
        "--min-workers and --max-workers Ray actors, growing and shrinking with the cluster\n"
        "and surviving the loss of workers.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.set_defaults(error=run.error)  # bad input found after parsing is reported with run's usage
    run.add_argument(
        "target",
        type=_target,
        metavar="FILE.py:FUNCTION",
        help="the training function (or MODULE:FUNCTION), or SCRIPT.py: a Horovod-style script run whole "
        "in every worker, taking the arguments after --",
    )

    workers = run.add_argument_group("workers")
    workers.add_argument("--min-workers", type=int, metavar="N", help="wait for at least N workers (required, or -np)")
    workers.add_argument(
        "--max-workers", type=int, metavar="N", help="never grow past N (default: -np, else --min-workers)"
    )
    workers.add_argument(
        "--resources-per-worker",
        type=_resources,
        action="extend",
        metavar="NAME=AMOUNT[,...]",
        help="Ray resources of one worker, e.g. CPU=2,GPU=1 (repeatable; default CPU=1)",
    )
    workers.add_argument(
        "--config",
        type=_key_value,
        nargs="+",
        action="extend",
        metavar="KEY=VALUE",
        help="entries of the config dict passed to FUNCTION; VALUE is parsed as JSON where it parses "
        "(5, 0.1, true, [1,2]), else taken as a string",
    )
    workers.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "pygloo", "nccl"),
        help="collective backend: auto (NCCL for GPU workers, else torch Gloo, else pygloo), gloo, pygloo or nccl "
        "(default: auto)",
    )

    hosts = run.add_argument_group("hosts and failures")
    hosts.add_argument(
        "--discovery-script",
        metavar="PATH",
        help="executable printing 'host' or 'host:slots' lines (default: every alive node of the Ray cluster)",
    )
    hosts.add_argument(
        "--discovery-interval", type=float, default=1.0, metavar="S", help="seconds between discovery polls (1)"
    )
    hosts.add_argument(
        "--discovery-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds one discovery call may take; a script still running is killed (30)",
    )
    hosts.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for --min-workers, a newcomer's boot or a placement (600)",
    )
    hosts.add_argument("--reset-limit", type=int, metavar="N", help="fail after N resets (default: unbounded)")
    hosts.add_argument(
        "--cooldown-range",
        type=float,
        nargs=2,
        default=(10.0, 300.0),
        metavar=("MIN", "MAX"),
        help="seconds a host whose worker failed gets no new worker, doubling per failure (10 300)",
    )
    hosts.add_argument(
        "--liveness-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="a worker not answering a ping within S seconds, and not computing, is killed as failed (5)",
    )
    hosts.add_argument(
        "--collective-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds one collective, or forming one ring, may take (300)",
    )
    hosts.add_argument(
        "--max-failures",
        type=int,
        default=0,
        metavar="N",
        help="exceptions of FUNCTION to retry as that worker's failure; 0 fails at the first (0)",
    )
    hosts.add_argument(
        "--evict-stragglers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let a persistently slow worker go gracefully when the run is predicted faster without it; "
        "--no-evict-stragglers only reports it (on)",
    )

    horovodrun = run.add_argument_group(
        "horovodrun's names", "horovodrun's elastic options, each the same as the option it names"
    )
    horovodrun.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        metavar="N",
        help="the default of --min-workers and --max-workers, and within them",
    )
    aliases = (
        ("--min-np", "--min-num-proc", "min_workers", {"type": int, "metavar": "N"}),
        ("--max-np", "--max-num-proc", "max_workers", {"type": int, "metavar": "N"}),
        ("--host-discovery-script", None, "discovery_script", {"metavar": "PATH"}),
        ("--blacklist-cooldown-range", None, "cooldown_range", {"type": float, "nargs": 2, "metavar": ("MIN", "MAX")}),
    )
    for name, long_name, dest, kwargs in aliases:
        names = [name] + ([long_name] if long_name else [])
        option = "--" + dest.replace("_", "-")
        horovodrun.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=f"same as {option}", **kwargs)
    horovodrun.add_argument(
        "--slots-per-host",
        type=int,
        metavar="N",
        help="slots of a host that --discovery-script prints without ':slots' (1)",
    )

    durable = run.add_argument_group("durable checkpoints")
    durable.add_argument(
        "--checkpoint-dir",
        metavar="DIR_OR_URL",
        help="local path or fsspec URL: rank 0 writes every --checkpoint-every-th commit there, and a run "
        "resumes from what it finds (default: in-memory commits only)",
    )
    durable.add_argument(
        "--checkpoint-every", type=int, default=10, metavar="K", help="commits between durable checkpoints (10)"
    )
    durable.add_argument(
        "--checkpoint-keep",
        type=int,
        default=2,
        metavar="N",
        help="how many of the newest durable checkpoints --checkpoint-dir keeps (2)",
    )

    results = run.add_argument_group("results")
    results.add_argument(
        "--keep-metrics",
        type=int,
        default=100_000,
        metavar="N",
        help="rank 0's newest N reports kept for the summary; older ones are only counted (100000)",
    )

    ray_group = run.add_argument_group("Ray")
    ray_group.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster to connect to, e.g. 10.0.0.1:6379 or auto (default: $RAY_ADDRESS, else a local Ray)",
    )
    ray_group.add_argument(
        "--verbose",
        type=int,
        choices=(0, 1),
        default=1,
        help="1 shows progress and a line per membership event, 0 only the summary (1)",
    )
    return parser


def load_function(target: str) -> Callable[..., Any]:
    """The function named by `FILE.py:FUNCTION` or `MODULE:FUNCTION`; ValueError naming what is missing."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py") or os.path.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"no such file: {where}")
        module_name = os.path.splitext(os.path.basename(path))[0]
        # like `python FILE.py`: the file's directory is importable, so its sibling imports work
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"loading {where} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ValueError(f"importing module {where} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{where} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{where}:{name} is not callable (it is a {type(fn).__name__})")
    if not _takes_one_argument(fn):
        raise ValueError(f"{where}:{name} must take one argument, the config dict")
    return fn


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind({})
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): let the worker find out
        return True
    return True


def load_script(target: str, script_args: Sequence[str]) -> Any:
    """`target` read and compiled here, as the `ScriptRun` every worker runs; ValueError naming what is wrong."""
    from ray_elastic.horovod.script import ScriptRun

    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {target}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        source = importlib.util.decode_source(raw)
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {target}: {e}") from e
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        raise ValueError(f"{target} does not compile: {e.msg} (line {e.lineno})") from e
    return ScriptRun(path, source, tuple(script_args), os.getcwd())


def world_bounds(args: argparse.Namespace) -> tuple[int, int]:
    """(min_workers, max_workers) from --min-workers/--min-np, --max-workers/--max-np and -np."""
    num_proc, low, high = args.num_proc, args.min_workers, args.max_workers
    if low is None:
        low = num_proc
    if low is None:
        raise ValueError("the following arguments are required: --min-workers (or -np, or --min-np)")
    if high is None:
        high = max(low, num_proc if num_proc is not None else low)
    if num_proc is not None and not low <= num_proc <= high:
        raise ValueError(f"-np ({num_proc}) must lie between --min-workers ({low}) and --max-workers ({high})")
    return low, high


def _discovery(args: argparse.Namespace) -> Any:
    """The discovery script's path, or with --slots-per-host a source that gives bare hosts that many slots."""
    if args.slots_per_host is None:
        return args.discovery_script
    if args.discovery_script is None:
        raise ValueError("--slots-per-host applies to the lines of --host-discovery-script: give one")
    if isinstance(args.slots_per_host, bool) or args.slots_per_host < 1:
        raise ValueError(f"--slots-per-host must be an integer >= 1, got {args.slots_per_host}")
    from ray_elastic.discovery import ScriptDiscovery, check_discovery_spec

    check_discovery_spec(args.discovery_script)
    per_worker = dict(args.resources_per_worker) if args.resources_per_worker else {"CPU": 1.0}
    return ScriptDiscovery(
        args.discovery_script, per_worker, default_slots=args.slots_per_host, timeout=args.discovery_timeout
    )


def make_trainer(args: argparse.Namespace) -> Any:
    """The `ElasticTrainer` the options describe; ValueError on bad input, before anything is spawned."""
    script_args = getattr(args, "script_args", [])
    if is_script(args.target):
        if args.config:
            raise ValueError("--config is for FILE.py:FUNCTION; SCRIPT.py takes its own arguments after --")
        train_fn = load_script(args.target, script_args)
    else:
        if script_args:
            raise ValueError("arguments after -- are for a SCRIPT.py; FILE.py:FUNCTION takes --config KEY=VALUE")
        train_fn = load_function(args.target)
    min_workers, max_workers = world_bounds(args)
    return _trainer_class()(
        train_fn,
        min_workers=min_workers,
        max_workers=max_workers,
        config=dict(args.config or []),
        resources_per_worker=dict(args.resources_per_worker) if args.resources_per_worker else None,
        discovery=_discovery(args),
        backend=args.backend,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.cooldown_range),
        discovery_interval=args.discovery_interval,
        discovery_timeout=args.discovery_timeout,
        liveness_timeout=args.liveness_timeout,
        collective_timeout=args.collective_timeout,
        max_failures=args.max_failures,
        evict_stragglers=args.evict_stragglers,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_keep=args.checkpoint_keep,
        keep_metrics=args.keep_metrics,
        verbose=args.verbose,
    )


def _option_names(message: str) -> str:
    """The trainer's messages name its arguments (`max_workers`); here they are options (`--max-workers`)."""
    for name in inspect.signature(_trainer_class()).parameters:
        if name not in ("train_fn", "config", "discovery", "verbose"):
            message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message


def _trainer_class() -> type:
    from ray_elastic.trainer import ElasticTrainer

    return ElasticTrainer


def summary(result: Any, seconds: float, return_value: bool = True) -> str:
    """What a user wants to see at the end: events, the last metrics, the return value (truncated)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 200
    short.maxdict = short.maxlist = 12
    lines = [f"ray-elastic: finished in {seconds:.1f} s with {result.resets} reset(s)", "events:"]
    for ev in result.events:
        took = f"{ev.reset_duration:.2f} s" if ev.reset_duration is not None else "-"
        lines.append(f"  {ev.kind:15s} world size {ev.world_size}  reset {took:>7s}  {ev.detail}")
    if result.metrics:
        lines.append(f"last metrics ({len(result.metrics)} reported): {short.repr(result.metrics[-1])}")
    if return_value:
        lines.append(f"return value: {short.repr(result.return_value)}")
    return "\n".join(lines)


def _unreachable(address: str | None, timeout: float = 5.0) -> str | None:
    """Why a `host:port` GCS address cannot be reached (None if it can, or is not of that form).

    `ray.init` retries an unreachable GCS for minutes; one bounded TCP connect says so at once.
    """
    if not address or "://" in address or ":" not in address:
        return None  # "auto", "local", a ray:// client address: Ray's own checks apply
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's arguments, and the script's: those after the first `--`."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _print_script_lines_as_they_are() -> Any:
    """Print the workers' output without Ray's `(WorkerActor pid=...)` prefix and deduplication.

    The script's lines already carry their rank, and Ray's deduplication
    would merge lines that differ only in numbers (the rank, a loss). This
    swaps the one handler `ray.init` installs in Ray's (internal) dispatcher
    of forwarded output and returns the `WorkerLinePrinter` put in its
    place; where that handler is missing, Ray's own printing stays and this
    returns None.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return None
    from ray_elastic.horovod.script import WorkerLinePrinter

    names = [name for name, _ in dispatcher.handlers]
    if "ray_print_logs" not in names:
        return None
    printer = WorkerLinePrinter()
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_elastic_script_lines", printer)
    return printer


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.script_args = script_args
    try:
        trainer = make_trainer(args)
    except ValueError as e:
        args.error(_option_names(str(e)))

    import ray

    from ray_elastic.exceptions import TrainingFailedError

    logging.basicConfig(format="%(message)s")
    if args.verbose:
        logging.getLogger("ray_elastic").setLevel(logging.INFO)
    problem = _unreachable(args.address)
    if problem:
        print(f"ray-elastic: cannot reach the Ray cluster at {args.address}: {problem}", file=sys.stderr)
        return 1
    try:
        ray.init(address=args.address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:
        print(f"ray-elastic: cannot connect to the Ray cluster at {args.address!r}: {e}", file=sys.stderr)
        return 1
    script = is_script(args.target)
    printer = _print_script_lines_as_they_are() if script else None
    start = time.monotonic()
    try:
        result = trainer.fit()
        if printer is not None and result.events:
            # Ray forwards output asynchronously: the lines the finishing workers printed last may be in flight
            missing = printer.wait_for_ends(result.events[-1].world_size, OUTPUT_TIMEOUT_S)
            if missing:
                print(
                    f"ray-elastic: {missing} stream(s) of the finishing workers had not reached the launcher "
                    f"{OUTPUT_TIMEOUT_S:g} s after the end: their last lines may be missing above",
                    file=sys.stderr,
                )
    except TrainingFailedError as e:
        print(f"ray-elastic: training failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ray-elastic: interrupted; the run's workers were released", file=sys.stderr)
        return 130
    finally:
        ray.shutdown()
    print(summary(result, time.monotonic() - start, return_value=not script))
    return 0


if __name__ == "__main__":
    sys.exit(main())
