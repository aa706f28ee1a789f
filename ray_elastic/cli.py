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
from typing import TYPE_CHECKING, Any

from ray_elastic import options

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

# how long the launcher waits, after a script's run, for the last lines its workers printed
OUTPUT_TIMEOUT_S = 10.0

EXAMPLES = """\
examples:
  ray-elastic run examples/digits.py:train_fn --min-workers 2 --max-workers 4
  ray-elastic run train.py -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh -- --epochs 5
  ray-elastic run examples/digits.py:train_fn --min-workers 2 --max-workers 8 \\
      --discovery-script examples/discover.sh --config epochs=5 lr=0.05 --address 10.0.0.1:6379
  ray-elastic run mypkg.train:main --min-workers 1 --max-workers 4 --resources-per-worker CPU=4

the function is called as FUNCTION(config) in every worker, config being the
dict built from --config. A discovery script prints one 'host' or 'host:slots'
line per host that may run workers (a host: a Ray node ID, or an IP address or
hostname that belongs to exactly one Ray node), as
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

    run_group = run.add_argument_group("what runs")
    run_group.add_argument(
        "--config",
        type=_key_value,
        nargs="+",
        action="extend",
        metavar="KEY=VALUE",
        help="entries of the config dict passed to FUNCTION; VALUE is parsed as JSON where it parses "
        "(5, 0.1, true, [1,2]), else taken as a string",
    )
    run_group.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        metavar="N",
        help="horovodrun's: the default of --min-workers and --max-workers, and within them",
    )
    hosts = run.add_argument_group("hosts")
    hosts.add_argument(
        "--discovery-script",
        "--host-discovery-script",
        dest="discovery_script",
        metavar="PATH",
        help="executable printing 'host' or 'host:slots' lines (default: every alive node of the Ray cluster); "
        "--host-discovery-script is horovodrun's name",
    )
    hosts.add_argument(
        "--slots-per-host",
        type=int,
        metavar="N",
        help="slots of a host that --discovery-script prints without ':slots' (1)",
    )
    # the run's options, one group per concern, from the one table (ray_elastic/options.py)
    options.add_cli_flags(run)

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
        assert spec is not None and spec.loader is not None  # a .py file's path always gives one
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
        **{**options.cli_values(args), "min_workers": min_workers, "max_workers": max_workers},
        config=dict(args.config or []),
        discovery=_discovery(args),
        verbose=args.verbose,
    )


def _option_names(message: str) -> str:
    """The trainer's messages name its options (`max_workers`); here they are flags (`--max-workers`)."""
    for option in options.OPTIONS:
        if option.help is not None:
            message = re.sub(rf"\b{option.name}\b", option.flag, message)
    return message


def _trainer_class() -> type:
    from ray_elastic import ElasticTrainer

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
    if result.metrics_history:
        lines.append(f"last metrics ({len(result.metrics_history)} reported): {short.repr(result.metrics)}")
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
    from ray_elastic import ray_private

    try:
        dispatcher = ray_private.stdstream_dispatcher()
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

    from ray_elastic import TrainingFailedError

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
