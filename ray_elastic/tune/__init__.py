"""Ray Tune: each trial an elastic run (`ElasticTrainer.as_trainable()`).

`as_trainable(trainer)` checks what a trial cannot do before Tune starts
anything, and returns a function trainable with its resource request: the
trial's reservation of `min_workers` workers (`placement.py`). The trial
itself is `trial.py`. Needs `ray[tune]` (the `tune` extra: `pip install -e '.[tune]'` in a checkout).
"""

from __future__ import annotations

from typing import Any

from ray_elastic.tune.placement import trial_resources


def as_trainable(trainer: Any) -> Any:
    """A Tune function trainable that runs `trainer` (an `ElasticTrainer`) once per trial."""
    try:
        from ray import tune
    except ImportError as e:
        raise ImportError(
            f"as_trainable() needs Ray Tune: pip install 'ray[tune]==2.60.*' (the 'tune' extra) ({e})"
        ) from e
    cfg = trainer.run_config
    if trainer.discovery is not None:
        raise ValueError(
            "as_trainable() places a trial's workers on the resources Tune reserved for it: "
            "leave discovery=None (the Ray cluster)"
        )
    if trainer.datasets:
        raise ValueError("as_trainable() does not take datasets= yet: read the data inside train_fn")
    if any(name != "CPU" and amount > 0 for name, amount in cfg.resources_per_worker.items()):
        raise ValueError(
            f"as_trainable() runs CPU workers for now (resources_per_worker={dict(cfg.resources_per_worker)}): "
            "a trial's workers run on its reservation, which GPUs cannot share by amount"
        )
    import copy

    from ray.tune.trainable.function_trainable import wrap_function

    from ray_elastic.tune.trial import run_trial, wait_for_release

    shipped = copy.copy(trainer)
    shipped.train_fn = None  # it travels inside the trainer's payload, pickled by value where workers need it

    def elastic_trial(config: dict[str, Any]) -> None:
        run_trial(shipped, config)

    class ElasticTrial(wrap_function(elastic_trial)):  # type: ignore[misc]  # Tune makes the base class at run time
        """Tune's function trainable, whose `stop()` returns only once the trial's run is released."""

        def cleanup(self) -> None:
            try:
                super().cleanup()
            finally:
                wait_for_release()

    return tune.with_resources(
        ElasticTrial, tune.PlacementGroupFactory(trial_resources(cfg.min_workers, cfg.resources_per_worker))
    )


__all__ = ["as_trainable"]
