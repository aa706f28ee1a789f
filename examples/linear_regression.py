"""Elastic linear regression with numpy only: `ObjectState` + allreduced gradients.

Every worker holds a shard of a synthetic regression problem, computes the
gradient of its shard, and averages it with the others through
`elastic.allreduce`. The weights and the step counter live in an
`ObjectState`, committed every few steps, so a worker's death rolls training
back only to the last commit and a newcomer receives the weights by sync.

    python examples/linear_regression.py          # on a local Ray it starts
"""

from __future__ import annotations

import numpy as np

import ray_elastic as elastic

TRUE_W = np.array([2.0, -3.0, 0.5, 1.0])


def make_shard(seed: int, n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, TRUE_W.size))
    y = x @ TRUE_W + 0.01 * rng.normal(size=n)
    return x, y


def train_fn(config: dict) -> dict:
    state = elastic.ObjectState(step=0, w=np.zeros(TRUE_W.size))

    @elastic.run
    def train(state: elastic.ObjectState) -> dict:
        x, y = make_shard(seed=elastic.rank())
        while state.step < config["steps"]:
            grad = 2 * x.T @ (x @ state.w - y) / len(y)
            grad = elastic.allreduce(grad, elastic.Average)
            state.w = state.w - config["lr"] * grad
            state.step += 1
            loss = float(np.mean((x @ state.w - y) ** 2))
            elastic.report({"step": state.step, "loss": loss, "world_size": elastic.size()})
            if config.get("step_hook"):
                config["step_hook"](state.step)
            if state.step % config.get("commit_every", 5) == 0:
                state.commit()
            else:
                state.check_host_updates()
        return {"w": state.w.tolist(), "steps": state.step, "world_size": elastic.size()}

    return train(state)


def main() -> None:
    trainer = elastic.ElasticTrainer(train_fn, min_workers=2, max_workers=4, config={"steps": 200, "lr": 0.05})
    result = trainer.fit()
    print("learned w:", np.round(result.return_value["w"], 3), "true w:", TRUE_W)
    print("final loss:", result.metrics["loss"])


if __name__ == "__main__":
    main()
