"""`ElasticDDPStrategy` and `ElasticEnvironment` for Trainers of the `pytorch_lightning` package."""

from __future__ import annotations

from ray_elastic.lightning.prepare import classes_for, prepare_trainer

_classes = classes_for("pytorch_lightning")
ElasticDDPStrategy = _classes.ElasticDDPStrategy
ElasticEnvironment = _classes.ElasticEnvironment

__all__ = ["ElasticDDPStrategy", "ElasticEnvironment", "prepare_trainer"]
