"""Every option of a run, declared once: its concern, default, check, meaning and other names.

`OPTIONS` is the one table. Each row is an `Option`, grouped by concern
(`CONCERNS`: scaling, failure, timeouts, checkpoint, data, results). The
views of an option are derived from its row:

- `RunConfig` (`config.py`) takes its fields' defaults from `DEFAULTS`, and
  `RunConfig.create` / `RunConfig.replace` check every value with `check`;
- `ElasticTrainer`'s docstring lists each option's `doc`, and the trainer
  passes its arguments on by the table's names;
- `ray-elastic run` (`cli.py`) adds one flag per row with a `cli` entry, in an
  argument group per concern, its help the row's `help` and its default the
  row's; `horovodrun`'s spelling of a flag (`horovodrun`) is an alias;
- `ray_elastic.horovod` maps a Horovod settings object onto options with
  `from_horovod` (the row's `horovod` field name).

A test holds `ElasticTrainer`'s keyword defaults and `RunConfig`'s fields to
this table.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("auto", "gloo", "pygloo", "nccl")
CONCERNS = ("scaling", "failure", "timeouts", "checkpoint", "data", "results")


@dataclass(frozen=True)
class Option:
    """One option of a run.

    - `name`: the keyword of `ElasticTrainer` and the field of `RunConfig`.
    - `concern`: one of `CONCERNS`.
    - `default`: its value when not given.
    - `check`: `check(name, value)` returns the value to keep, or raises a
      `ValueError` naming the option and the bad value.
    - `doc`: what it means (the trainer's docstring).
    - `help`: one line for `ray-elastic run --help`, or None: no flag.
    - `cli`: argparse keywords of the flag besides its help and default.
    - `horovodrun`: `horovodrun`'s own spellings of the flag, accepted as aliases.
    - `horovod`: the field of Horovod's settings objects that holds it, if any.
    """

    name: str
    concern: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str
    help: str | None = None
    cli: Mapping[str, Any] = field(default_factory=dict)
    horovodrun: tuple[str, ...] = ()
    horovod: str | None = None

    @property
    def flag(self) -> str:
        """The command-line flag: `--` and the name with hyphens."""
        return "--" + self.name.replace("_", "-")


def check_int(minimum: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        return value

    return check


def check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _or_none(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def maybe(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return maybe


def _check_backend(name: str, value: Any) -> str:
    if value not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_cooldown(name: str, value: Any) -> tuple[float, float]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        or not 0 <= value[0] <= value[1]
    ):
        raise ValueError(f"{name} must be (min_s, max_s) with 0 <= min_s <= max_s, got {value!r}")
    return float(value[0]), float(value[1])


def _check_resources(name: str, resources: Any) -> dict[str, float]:
    if resources is None:
        return {"CPU": 1.0}
    if not isinstance(resources, Mapping) or not resources:
        raise ValueError(f"{name} must be a non-empty dict like {{'CPU': 1}}, got {resources!r}")
    out: dict[str, float] = {}
    for key, amount in resources.items():
        if not isinstance(key, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"{name} entries must be name -> number, got {key!r}: {amount!r}")
        if amount < 0 or math.isnan(amount) or math.isinf(amount):
            raise ValueError(f"{name}[{key!r}] must be a finite number >= 0, got {amount!r}")
        out[key] = float(amount)
    if not any(out.values()):
        raise ValueError(f"{name} must ask for some resource (all amounts are 0)")
    if "object_store_memory" in out:
        # Ray refuses it as an actor resource; only a node's start options set the object store's size
        raise ValueError(
            f"{name} cannot ask for 'object_store_memory' (Ray sets the object store per node, "
            "not per actor); use 'memory' for a worker's heap"
        )
    return out


def _check_checkpoint_dir(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{name} must be a path or an fsspec URL, got {value!r}")
    from ray_elastic.checkpoint import CheckpointError, CheckpointStore, normalize_url

    url = normalize_url(value)
    try:
        CheckpointStore(url)
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    return url


def _check_names(name: str, value: Any) -> tuple[str, ...]:
    names = tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{name} must name datasets with strings, got {value!r}")
    return names


def _resource_pairs(text: str) -> list[tuple[str, float]]:
    """`CPU=1,GPU=0.5` as (name, amount) pairs (the flag may repeat: they are collected)."""
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


_N = {"type": int, "metavar": "N"}
_S = {"type": float, "metavar": "S"}

OPTIONS: tuple[Option, ...] = (
    # ---- scaling: how many workers, of what, growing how ----
    Option(
        "min_workers", "scaling", None, check_int(1),
        "the run waits (up to `elastic_timeout`) until this many workers are ready, and pauses if fewer remain.",
        "wait for at least N workers (required, or -np)", _N, ("--min-np", "--min-num-proc"), "min_num_proc",
    ),
    Option(
        "max_workers", "scaling", None, check_int(1),
        "the world never grows beyond this.",
        "never grow past N (default: -np, else --min-workers)", _N, ("--max-np", "--max-num-proc"), "max_num_proc",
    ),
    Option(
        "resources_per_worker", "scaling", None, _check_resources,
        'one worker\'s Ray resources (default `{"CPU": 1}`); each worker gets a placement group with one such bundle.',
        "Ray resources of one worker, e.g. CPU=2,GPU=1 (repeatable; default CPU=1)",
        {"type": _resource_pairs, "action": "extend", "metavar": "NAME=AMOUNT[,...]"},
    ),
    Option(
        "backend", "scaling", "auto", _check_backend,
        '"auto" (NCCL for GPU workers, else torch Gloo if torch is installed, else pygloo), "gloo", "pygloo" or '
        '"nccl" (GPU workers: `resources_per_worker` must ask for a GPU).',
        "collective backend: auto (NCCL for GPU workers, else torch Gloo, else pygloo), gloo, pygloo or nccl",
        {"choices": BACKENDS},
    ),
    Option(
        "discovery_interval", "scaling", 1.0, check_seconds,
        "seconds between discovery polls.",
        "seconds between discovery polls", _S,
    ),
    Option(
        "spares", "scaling", 0, check_int(0),
        "hot spares: this many workers booted ahead of need (placement, process, torch and `train_fn`'s set-up up "
        "to the run loop), out of every ring and holding no state. When a member dies, is withdrawn or let go, a "
        "spare takes its place in the next generation (it receives the state there), so the world is back at full "
        "strength without a boot on the critical path; a new spare then starts in the background. Spares take "
        "only the slots the members (up to `max_workers`) leave free, count against the cluster's resources and "
        "not against `max_workers`, and go on other nodes than the members where the cluster allows.",
        "hot spares: N workers booted ahead of need, promoted into a dead member's place (default 0)", _N,
    ),
    Option(
        "evict_stragglers", "scaling", True, _check_bool,
        "let a worker go when it is persistently slower than the others (1.5x their median compute per step for "
        "~15 s) and the run is predicted faster without it: it leaves gracefully (no step redone), its host cools "
        "down over `cooldown_range` and is offered again on probation (default True). False keeps it and only "
        "reports it (a warning and a `straggler_found` event). Never below `min_workers`.",
        "let a persistently slow worker go gracefully when the run is predicted faster without it; "
        "--no-evict-stragglers only reports it",
        {"action": argparse.BooleanOptionalAction},
    ),
    # ---- failure: what a failure costs, and when the run gives up ----
    Option(
        "reset_limit", "failure", None, _or_none(check_int(0)),
        "fail after this many resets (None: unbounded).",
        "fail after N resets (default: unbounded)", _N, (), "reset_limit",
    ),
    Option(
        "cooldown_range", "failure", (10.0, 300.0), _check_cooldown,
        "(min, max) seconds a host whose worker failed is held back, doubling with each failure, then offered "
        "again.",
        "seconds a host whose worker failed gets no new worker, doubling per failure",
        {"type": float, "nargs": 2, "metavar": ("MIN", "MAX")}, ("--blacklist-cooldown-range",), "cooldown_range",
    ),
    Option(
        "max_failures", "failure", 0, check_int(-1),
        "how many failures of the run to retry, counted as Ray Train's `FailureConfig(max_failures=)` counts them: "
        "every rank whose `train_fn` raises in one attempt (one generation) is one failure; the ranks keep their "
        "processes and all re-enter from the last commit. 0 (default) fails the run at the first exception, with its "
        "traceback; -1 retries without limit. Worker deaths are recovered in place and never counted.",
        "failures of the run (attempts in which FUNCTION raised) to retry in place; 0 fails at the first, -1: no limit",
        _N,
    ),
    # ---- timeouts: every wait of the run is bounded by one of these ----
    Option(
        "elastic_timeout", "timeouts", 600.0, check_seconds,
        "seconds to wait for `min_workers` (at start and after losing workers), for a newcomer to boot and for "
        "placement; and the longest `fit()` waits for a driver actor that answers nothing.",
        "seconds to wait for --min-workers, a newcomer's boot or a placement", _S, (), "elastic_timeout",
    ),
    Option(
        "discovery_timeout", "timeouts", 30.0, check_seconds,
        "seconds one discovery call (callable or script) may take; a script still running then is killed. The "
        "first failure fails the run; later ones are retried with a warning until `elastic_timeout` passes "
        "without a success. It also bounds `fit()`'s own look at `checkpoint_dir` before the run starts.",
        "seconds one discovery call may take; a script still running is killed", _S,
    ),
    Option(
        "liveness_timeout", "timeouts", 2.0, check_seconds,
        "a worker that does not answer a ping within this many seconds and uses no CPU is killed and treated as "
        "failed; one busy in a long C call that holds the GIL, or runnable but starved of CPU on a loaded node, is "
        "spared up to `collective_timeout`. A node that goes silent (no worker and no probe there answers) is "
        "found within about this long plus a third of it.",
        "a worker not answering a ping within S seconds, and not computing, is killed as failed", _S,
    ),
    Option(
        "collective_timeout", "timeouts", 300.0, check_seconds,
        "seconds one collective (or forming one ring) may take.",
        "seconds one collective, or forming one ring, may take", _S, (), "timeout_s",
    ),
    Option(
        "checkpoint_timeout", "timeouts", None, _or_none(check_seconds),
        "seconds one durable checkpoint write, the final flush, a resume's read, or a hand-over to Ray Tune may "
        "take (None, the default: `collective_timeout`).",
        "seconds one durable checkpoint write or read may take (default: --collective-timeout)", _S,
    ),
    # ---- checkpoint: durable checkpoints ----
    Option(
        "checkpoint_dir", "checkpoint", None, _check_checkpoint_dir,
        "a local directory or an fsspec URL for durable checkpoints (None: in-memory commits only). Rank 0 writes "
        "the committed state there every `checkpoint_every` commits, as plain files (`torch.save`d state dicts, "
        "JSON) in a directory of its own, complete before it counts; a `fit()` that finds a checkpoint there "
        "resumes from the latest, and a run that loses every worker at once resumes from it with fresh workers. "
        "`Result.checkpoint` is the last one.",
        "local path or fsspec URL: rank 0 writes every --checkpoint-every-th commit there, and a run resumes from "
        "what it finds (default: in-memory commits only)",
        {"metavar": "DIR_OR_URL"},
    ),
    Option(
        "checkpoint_every", "checkpoint", 10, check_int(1),
        "commits between two durable checkpoints (default 10).",
        "commits between durable checkpoints", {"type": int, "metavar": "K"},
    ),
    Option(
        "checkpoint_keep", "checkpoint", 2, check_int(1),
        "how many of the newest checkpoints `checkpoint_dir` keeps (default 2: the latest, and the one before it "
        "while the latest is written); older ones are removed after each write.",
        "how many of the newest durable checkpoints --checkpoint-dir keeps", _N,
    ),
    # ---- data: Ray Data input ----
    Option(
        "datasets", "data", (), _check_names,
        "Ray Datasets by name (`{\"train\": ray.data.read_parquet(...)}`), streamed by the run's feed actor; "
        "inside `train_fn`, `elastic.get_dataset_shard(name)` is this rank's shard, trained exactly once per epoch "
        "through every reset when it is in the committed state (`docs/data.md`). Needs `ray[data]` (the "
        "`data` extra). The run's options hold their names.",
    ),
    Option(
        "data_cpus", "data", 1, check_int(0),
        "with `datasets=`, how many whole CPUs of the cluster the workers leave free for Ray Data's read and map "
        "tasks (default 1: what one task asks for by default; raise it for a pipeline whose tasks or actors ask "
        "for more). Workers holding every CPU starve the pipeline. 0 lets the workers take every CPU.",
    ),
    Option(
        "data_starvation_timeout", "data", 60.0, check_seconds,
        "seconds a rank may wait for a block that the pipeline does not produce while the cluster has no free "
        "CPU; then the run fails with a `DataStarvedError` naming `data_cpus` (default 60).",
    ),
    # ---- results: what fit() keeps ----
    Option(
        "keep_metrics", "results", 100_000, _or_none(check_int(0)),
        "how many of rank 0's newest reports `Result.metrics_history` keeps (default 100,000; None keeps all); "
        "older ones are counted in `Result.metrics_dropped`. The driver holds only the reports `fit()` has not "
        "fetched yet, so its memory stays bounded either way.",
        "rank 0's newest N reports kept for the summary; older ones are only counted", _N,
    ),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS}


def by_concern() -> Iterator[tuple[str, list[Option]]]:
    """Each concern with its options, in the table's order."""
    for concern in CONCERNS:
        yield concern, [o for o in OPTIONS if o.concern == concern]


def check_all(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every option checked, in the table's order: the given value, else the default; unknown names refused."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(BY_NAME)}")
    return {o.name: o.check(o.name, values.get(o.name, o.default)) for o in OPTIONS}


def docs(indent: str = "        ", width: int = 110) -> str:
    """The `Args:` entries of every option, as `ElasticTrainer`'s docstring lists them."""
    import textwrap

    lines = []
    for o in OPTIONS:
        lines += textwrap.wrap(
            f"{o.name}: {o.doc}", width, initial_indent=indent, subsequent_indent=indent + "    "
        )
    return "\n".join(lines)


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group per concern, one flag per option with a `help` (and its `horovodrun` aliases)."""
    for concern, options in by_concern():
        flagged = [o for o in options if o.help is not None]
        if not flagged:
            continue
        group = parser.add_argument_group(concern)
        for o in flagged:
            text = o.help or ""
            shown = "" if o.default is None or "default" in text else f" ({_shown(o.default)})"
            group.add_argument(o.flag, dest=o.name, default=o.default, help=text + shown, **o.cli)
            for alias in o.horovodrun:  # horovodrun's spelling: an argument of its own, so errors name the flag used
                group.add_argument(alias, dest=o.name, default=argparse.SUPPRESS, help=f"same as {o.flag}", **o.cli)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options `ray-elastic run`'s flags set, by name (a flag's list of pairs made the dict it stands for)."""
    values = {o.name: getattr(args, o.name) for o in OPTIONS if o.help is not None}
    if values.get("resources_per_worker") is not None:
        values["resources_per_worker"] = dict(values["resources_per_worker"])
    if values.get("cooldown_range") is not None:
        values["cooldown_range"] = tuple(values["cooldown_range"])
    return values


def from_horovod(settings: Any) -> dict[str, Any]:
    """The options a Horovod settings object sets: each field the table maps, present and not None, by name."""
    return {
        o.name: getattr(settings, o.horovod)
        for o in OPTIONS
        if o.horovod is not None and getattr(settings, o.horovod, None) is not None
    }


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
