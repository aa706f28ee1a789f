"""PyTorch Lightning, elastic in place: survivors of a failure keep their process and their Trainer.

    from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer

    def train_fn(config):
        trainer = pl.Trainer(max_epochs=3, strategy=ElasticDDPStrategy(), plugins=[ElasticEnvironment()])
        prepare_trainer(trainer).fit(model, datamodule=dm)

The names are Ray Train's (`RayDDPStrategy`, `RayLightningEnvironment`,
`prepare_trainer`). These classes are for `lightning.pytorch` (or, where
only it is installed, `pytorch_lightning`);
`ray_elastic.lightning.pytorch_lightning` has the same names for
`pytorch_lightning`. `prepare_trainer` takes a Trainer of either package.
"""

from __future__ import annotations

import importlib.util

from ray_elastic.lightning.prepare import LightningState, classes_for, prepare_trainer

_PACKAGE = "lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning"
_classes = classes_for(_PACKAGE)
ElasticDDPStrategy = _classes.ElasticDDPStrategy
ElasticEnvironment = _classes.ElasticEnvironment

__all__ = ["ElasticDDPStrategy", "ElasticEnvironment", "LightningState", "prepare_trainer"]
