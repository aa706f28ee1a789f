"""Ray Data input, exact per epoch through every membership change (the `data` extra: `ray[data]`).

`ElasticTrainer(..., datasets={"train": ds})` streams each dataset through
the run's feed actor (`feed.py`); inside `train_fn`,
`elastic.get_dataset_shard("train")` is this rank's `DataShard`
(`shard.py`), whose position a commit saves; `plan.py` is the arithmetic of
who takes which rows.
"""

from __future__ import annotations

from ray_elastic.data.shard import DataShard, get_dataset_shard

__all__ = ["DataShard", "get_dataset_shard", "check_datasets"]

EXTRA = "pip install 'ray[data]==2.60.*' (the 'data' extra of ray-elastic)"


def check_datasets(datasets: object) -> dict[str, object]:
    """`datasets=` as given to `ElasticTrainer`, checked before anything starts: name -> Ray Dataset."""
    if datasets is None:
        return {}
    try:
        from ray.data import Dataset
    except ImportError as e:
        raise ImportError(f"datasets= needs Ray Data, which is not installed: {EXTRA} ({e})") from e
    if not isinstance(datasets, dict):
        raise ValueError(f"datasets must be a dict of name -> ray.data.Dataset, got {type(datasets).__name__}")
    for name, dataset in datasets.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"dataset names must be non-empty strings, got {name!r}")
        if not isinstance(dataset, Dataset):
            raise ValueError(
                f"datasets[{name!r}] must be a ray.data.Dataset (e.g. ray.data.read_parquet(...)), "
                f"got {type(dataset).__name__}"
            )
    return dict(datasets)
