"""Horovod's API on ray-elastic: run Horovod Elastic scripts with one import line changed.

    import ray_elastic.horovod.torch as hvd      # was: import horovod.torch as hvd

    ray-elastic run train.py -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh -- --epochs 5

`ray_elastic.horovod.torch` maps Horovod's PyTorch names and signatures onto
ray-elastic's ring (`ray_elastic.horovod.torch.elastic` holds `run`, the
states and `ElasticSampler`); `ray_elastic.horovod.common.exceptions` holds
the two exceptions where Horovod scripts import them from. `ray-elastic run
SCRIPT.py` (see `ray_elastic.cli`) runs the whole script in every worker, as
`horovodrun` does. A Horovod name without a counterpart here raises an error
that names it; none is accepted and silently ignored.
"""
