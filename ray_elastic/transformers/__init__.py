"""Hugging Face `transformers.Trainer`, elastic in place: `prepare_trainer`.

    from ray_elastic.transformers import prepare_trainer
    trainer = prepare_trainer(transformers.Trainer(model=model, args=args, train_dataset=ds))
    trainer.train()                      # inside train_fn, under ElasticTrainer.fit()

`prepare_trainer` (Ray Train's name) returns the same `Trainer`, whose
`train()` runs inside `@elastic.run`: a lost worker rolls the survivors back
to the last in-memory commit and they go on in the same process; added
workers receive the commit and train from the same step. What the adapter
does and refuses is in `ray_elastic.transformers.trainer` and docs/transformers.md.
"""

from ray_elastic.transformers.trainer import prepare_trainer, refusals

__all__ = ["prepare_trainer", "refusals"]
