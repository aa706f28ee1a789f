"""Horovod scripts on ray-elastic, without Ray: `ray_elastic.horovod.torch` and the launcher.

How Horovod's arguments map (ops, compression, process sets, the
optimizer's options), the clear errors for names with no counterpart, the
launcher's horovodrun options and its refusals of bad input, and the rank
prefix of the workers' lines. integration/test_horovod_compat_cluster.py runs
the scripts.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ray_elastic
import ray_elastic.horovod.torch as hvd
from ray_elastic import cli
from ray_elastic.assignment import WorkerSlot
from ray_elastic.horovod.common import elastic as common_elastic
from ray_elastic.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ray_elastic.horovod.script import END_OF_OUTPUT, RankPrefixedStream, WorkerLinePrinter, rank_prefixed_output
from ray_elastic.horovod.torch.ops import reduce_op
from ray_elastic.runtime.process import set_current

# ---- the module, without Ray ---------------------------------------------------------------


def test_horovod_exception_imports_are_the_librarys_classes():
    assert HorovodInternalError is ray_elastic.HorovodInternalError is hvd.HorovodInternalError
    assert HostsUpdatedInterrupt is ray_elastic.HostsUpdatedInterrupt


@pytest.mark.parametrize(
    ("op", "average", "want"),
    [
        (None, None, ray_elastic.Average),
        (hvd.Sum, None, ray_elastic.Sum),
        (hvd.Min, None, ray_elastic.Min),
        (hvd.Max, None, ray_elastic.Max),
        (None, True, ray_elastic.Average),
        (None, False, ray_elastic.Sum),
    ],
)
def test_ops_and_the_deprecated_average_flag_map_to_the_rings_ops(op, average, want):
    assert reduce_op(op, average) is want


def test_ops_without_counterpart_fail_naming_themselves():
    with pytest.raises(NotImplementedError, match=r"op=hvd.Adasum\) is not supported"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="hvd.Product"):
        hvd.allreduce_(torch.ones(2), op=hvd.Product)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(torch.ones(2), op=hvd.Sum, average=True)
    with pytest.raises(NotImplementedError, match=r"allgather\(process_set=...\) is not supported"):
        hvd.allgather(torch.ones(2), process_set=object())
    with pytest.raises(NotImplementedError, match=r"hvd.join\(\) is not supported"):
        hvd.join()


@pytest.mark.parametrize("name", ["alltoall", "reducescatter", "SyncBatchNorm", "add_process_set", "start_timeline"])
def test_names_without_counterpart_raise_attribute_errors_naming_them(name):
    with pytest.raises(AttributeError, match=rf"hvd.{name} is not supported by ray_elastic.horovod.torch"):
        getattr(hvd, name)
    assert not hasattr(hvd, name)


def test_init_outside_a_worker_says_how_to_launch():
    with pytest.raises(RuntimeError, match=r"run this script with `ray-elastic run SCRIPT.py"):
        hvd.init()
    assert not hvd.is_initialized()


class _PlacedWorker:
    """What hvd.init() reads of a worker: its id and its slot in the generation it joined."""

    def __init__(self, worker_id, rank):
        self.worker_id = worker_id
        self.slot = WorkerSlot(worker_id, "node-a", rank, 2, rank, 2, 0, 1)

    def joined(self):
        return SimpleNamespace(slot=self.slot)


def test_init_sets_this_workers_first_place_over_a_horovod_rank_the_process_inherited(monkeypatch):
    # a local Ray cluster's workers inherit the environment of the process that started it: one that
    # had run a horovod.ray worker in-process carried HOROVOD_RANK=0 into every rank (a CI failure)
    monkeypatch.setattr(os, "environ", {**os.environ, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "7"})
    monkeypatch.setattr(hvd, "_placed_worker", None)
    try:
        set_current(_PlacedWorker("w2", rank=1))
        hvd.init()
        assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"]) == ("1", "2")
        # after a reset the variables keep the first place, as horovodrun's do
        set_current(_PlacedWorker("w2", rank=0))
        hvd.init()
        assert os.environ["HOROVOD_RANK"] == "1"
    finally:
        set_current(None)


def test_fp16_compression_sends_half_and_returns_the_original_dtype():
    x = torch.tensor([1.0, 2.5, 1e-3], dtype=torch.float64)
    wire, ctx = hvd.Compression.fp16.compress(x)
    assert wire.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, x, rtol=1e-3)
    ints = torch.arange(3)
    assert hvd.Compression.fp16.decompress(*hvd.Compression.fp16.compress(ints)) is ints


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"op": hvd.Adasum}, NotImplementedError, "Adasum"),
        ({"op": hvd.Min}, ValueError, "op must be hvd.Average, hvd.Sum"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError, "not supported with op != Average"),
        ({"gradient_predivide_factor": 0.0}, ValueError, "must be > 0"),
        ({"compression": object()}, NotImplementedError, "Compression.none and Compression.fp16"),
        ({"process_set": object()}, NotImplementedError, "process_set"),
    ],
)
def test_distributed_optimizer_refuses_what_it_cannot_honour(kwargs, error, message):
    model = make_model()
    with pytest.raises(error, match=re.escape(message)):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_distributed_optimizer_checks_named_parameters_as_horovod_does():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique; duplicates: w"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="2 of the optimizer's parameters are not in it"):
        hvd.DistributedOptimizer(opt, named_parameters=named[:2])
    wrapped = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=2, gradient_predivide_factor=4.0
    )
    assert wrapped.param_groups is opt.param_groups and wrapped.backward_passes_per_step == 2


def test_horovod_states_take_horovods_signatures_and_call_reset_before_the_callbacks():
    calls = []

    class Counter(common_elastic.ObjectState):
        def reset(self):
            calls.append(("reset", self.epoch))

    state = Counter(hvd.broadcast_object, hvd.rank, epoch=3)
    state.register_reset_callbacks([lambda: calls.append(("callback", state.epoch))])
    state.epoch = 5
    state.restore()
    state.on_reset()
    assert calls == [("reset", 3), ("callback", 3)]
    model = make_model()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    torch_state = hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler, epoch=0)
    assert torch_state.model is model and torch_state.sampler is sampler
    assert isinstance(torch_state, ray_elastic.State) and hvd.elastic.run is ray_elastic.run


# ---- the launcher's arguments, without Ray ---------------------------------------------------


def bounds(*argv: str) -> tuple[int, int]:
    args = cli.build_parser().parse_args(["run", "train.py", *argv])
    return cli.world_bounds(args)


def test_horovodrun_world_options_map_to_min_and_max_workers():
    assert bounds("-np", "2") == (2, 2)
    assert bounds("-np", "2", "--min-np", "1") == (1, 2)
    assert bounds("-np", "2", "--min-np", "1", "--max-np", "4") == (1, 4)
    assert bounds("--num-proc", "3", "--max-num-proc", "5") == (3, 5)
    assert bounds("--min-workers", "2", "--max-workers", "3") == (2, 3)
    with pytest.raises(ValueError, match=r"-np \(5\) must lie between --min-workers \(1\) and --max-workers \(4\)"):
        bounds("-np", "5", "--min-np", "1", "--max-np", "4")


def test_horovodrun_host_options_are_the_trainers():
    args = cli.build_parser().parse_args(
        ["run", "train.py", "--host-discovery-script", "d.sh", "--blacklist-cooldown-range", "1", "2"]
    )
    assert args.discovery_script == "d.sh" and args.cooldown_range == [1.0, 2.0]
    assert cli.build_parser().parse_args(["run", "train.py"]).cooldown_range == (10.0, 300.0)


def test_script_arguments_are_what_follows_the_first_double_dash():
    assert cli.split_script_args(["run", "t.py", "-np", "2", "--", "--epochs", "3", "--", "x"]) == (
        ["run", "t.py", "-np", "2"],
        ["--epochs", "3", "--", "x"],
    )


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("import ray_elastic.horovod.torch as hvd\nhvd.init()\n")
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{script}"], "the following arguments are required: --min-workers (or -np, or --min-np)"),
        (["{dir}/missing.py", "-np", "2"], "no such file"),
        (["{broken}", "-np", "2"], "does not compile: invalid syntax (line 2)"),
        (["{script}", "-np", "2", "--config", "a=1"], "--config is for FILE.py:FUNCTION"),
        (["{script}:f", "--min-workers", "1", "--", "--epochs", "2"], "arguments after -- are for a SCRIPT.py"),
        (["{script}", "-np", "2", "--slots-per-host", "2"], "--slots-per-host applies to the lines"),
        (["{script}", "-np", "3", "--max-np", "2"], "-np (3) must lie between"),
        (["{script}", "-np", "0"], "--min-workers must be an integer >= 1"),
    ],
)
def test_bad_script_runs_fail_before_anything_starts(capsys, script, args, message):
    broken = script.parent / "broken.py"
    broken.write_text("import os\ndef (:\n")
    argv = ["run", *(a.format(script=script, dir=script.parent, broken=broken) for a in args)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---- the workers' output -----------------------------------------------------------------------


def test_worker_lines_carry_their_rank_and_partial_lines_wait_for_their_end():
    target = io.StringIO()
    stream = RankPrefixedStream(target, "stdout")
    stream.write("epoch 1 ")
    assert target.getvalue() == ""
    stream.write("loss 0.5\nnext")
    stream.flush()
    assert target.getvalue() == "[?]<stdout>:epoch 1 loss 0.5\n[?]<stdout>:next\n"


def test_the_launcher_prints_script_lines_unchanged_and_labels_the_rest(capsys):
    printer = WorkerLinePrinter()
    printer({"is_err": False, "pid": 7, "actor_name": "WorkerActor", "lines": ["[1]<stdout>:hi", "boot"]})
    printer({"is_err": True, "pid": "autoscaler", "lines": ["status report"]})
    out, err = capsys.readouterr()
    assert out == "[1]<stdout>:hi\n(WorkerActor pid=7) boot\n" and err == ""


def test_the_launcher_waits_for_every_finishing_workers_last_lines(capsys):
    printer = WorkerLinePrinter()
    printer({"is_err": False, "pid": 7, "lines": ["[0]<stdout>:last", END_OF_OUTPUT]})
    printer({"is_err": True, "pid": 7, "lines": [END_OF_OUTPUT]})
    printer({"is_err": False, "pid": 8, "lines": [END_OF_OUTPUT]})
    assert printer.wait_for_ends(2, timeout=0.05) == 1  # worker 8's stderr has not ended
    last = {"is_err": True, "pid": 8, "lines": ["[1]<stderr>:bye", END_OF_OUTPUT]}
    late = threading.Timer(0.2, printer, args=(last,))
    late.start()
    assert printer.wait_for_ends(2, timeout=30) == 0
    late.join()
    out, err = capsys.readouterr()
    assert out == "[0]<stdout>:last\n" and err == "[1]<stderr>:bye\n"  # the markers are not printed


def test_only_a_script_that_ran_to_its_end_marks_the_end_of_its_output(monkeypatch):
    """A worker that left mid-run (its host removed) must not count as one of the finishing workers."""
    for raised in (False, True):
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        try:
            with rank_prefixed_output():
                print("working")
                if raised:
                    raise SystemExit(0)
        except SystemExit:
            pass
        marks = [s.getvalue().count(END_OF_OUTPUT) for s in (out, err)]
        assert marks == ([0, 0] if raised else [1, 1]), (raised, out.getvalue(), err.getvalue())
        assert "working" in out.getvalue()
