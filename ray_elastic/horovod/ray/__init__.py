"""horovod.ray's API on ray-elastic: `from ray_elastic.horovod.ray import RayExecutor, ElasticRayExecutor`.

A horovod.ray driver script changes two import lines (`horovod.torch` and
`horovod.ray`) and runs as it is:

    import ray_elastic.horovod.torch as hvd
    from ray_elastic.horovod.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()
    ranks = executor.run(lambda: (hvd.init(), hvd.rank())[1])   # [0, 1, 2, 3]: every worker's value, by rank
    executor.shutdown()

Where the workers live between calls: a static `RayExecutor` keeps its
workers, their ring and their executable from `start()` to `shutdown()`
(one long `ElasticTrainer.fit()` whose workers serve each call as a
command), because horovod.ray's users rely on it: an executable built once
and stepped by many `execute()` calls (Ray Tune's Horovod trainable), and a
ring formed once rather than per call. Elastic mode (`min_workers=`, and
`ElasticRayExecutor`) starts fresh workers per `run()`, as horovod.ray does:
its workers come and go with the hosts anyway.

Inside the function, `hvd.init()`, `hvd.elastic.run`, `hvd.elastic.TorchState`
and `ElasticSampler` work as under `ray-elastic run`; `ray_logger.log(dict)`
feeds the `callbacks`. Arguments without a counterpart warn naming
themselves; those that cannot be honoured raise naming themselves. See
docs/migrating-from-horovod.md ("From horovod.ray").
"""

from ray_elastic.horovod.ray import ray_logger
from ray_elastic.horovod.ray.elastic import ElasticRayExecutor, HostDiscovery, RayHostDiscovery, TestDiscovery
from ray_elastic.horovod.ray.runner import RayExecutor
from ray_elastic.horovod.ray.settings import HorovodRayWarning
from ray_elastic.horovod.ray.worker import BaseHorovodWorker

__all__ = [
    "BaseHorovodWorker",
    "ElasticRayExecutor",
    "HorovodRayWarning",
    "HostDiscovery",
    "RayExecutor",
    "RayHostDiscovery",
    "TestDiscovery",
    "ray_logger",
]
