"""The trainer side: what runs in the user's process, around `fit()`.

- `elastic_trainer`: `ElasticTrainer` and `Result`, what the user calls and gets back;
- `preflight`: the checks made before anything is spawned (the arguments, the cluster, the checkpoint directory);
- `driver_watch`: following the driver actor while it runs: its reports and its outcome;
- `progress_bar`: the progress bar and one line per membership event;
- `ray_output`: what Ray itself would print in this terminal, and the one dump kept out of it;
- `timeline`: `Result.plot_timeline`.

The driver side is `driver_actor.py` and `driver/`; the worker side is `worker_actor.py` and `runtime/`.
"""

from ray_elastic.trainer.elastic_trainer import ElasticTrainer, Result

__all__ = ["ElasticTrainer", "Result"]
