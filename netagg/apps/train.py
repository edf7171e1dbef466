"""Data-parallel training through the switch: a small MLP on synthetic data, with the gradients
allreduced (mean) by netagg workers, with or without priority drop. `tests/test_training.py`
runs it; a benchmark may call `train` with other sizes or another switch.

The data (`make_data`): `classes` Gaussian clusters in `features` dimensions (cluster means
drawn N(0, 1), points = mean + N(0, noise^2) per dimension, the dimensions then scaled by
factors drawn in [0.25, 1.75], so that some weight rows get smaller gradients than others),
split into a training set and a test set, all from one seed.

The model: features -> hidden (ReLU) -> classes, softmax cross-entropy, SGD with momentum.
Each of `workers` in-process workers (`host.Worker` on one backend, the golden model by
default) keeps its own copy of the parameters and draws its minibatches from its own shard of
the training set; each step, every worker allreduces its gradients (one tensor per layer
parameter, each with its layer's priority class) as a mean, and applies the result. The
results are the same on every worker (every worker takes the same result packets), so the
copies stay equal, which `train` checks at the end.

Priority drop: `drop_classes` sets the switch's drop threshold of those classes to 0, so an
idle switch turns every droppable contribution of those classes into a null: each worker
then loses, per tensor, the floor(loss_budget * chunks) chunks it marked droppable (its
smallest), within the allowance the engine scales for (see `host.checklane`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np

from netagg.contract import regmap as R
from netagg.host.control import SwitchControl
from netagg.host.worker import Worker

# Layer priorities: the first layer's weights (most of the gradient) in the default class,
# its biases and the output layer higher.
PRIORITIES = {"W1": 4, "b1": 6, "W2": 5, "b2": 6}


@dataclasses.dataclass
class Data:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def make_data(seed: int = 0, features: int = 64, classes: int = 10, n_train: int = 4000,
              n_test: int = 4000, noise: float = 2.0) -> Data:
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((classes, features))
    scale = rng.uniform(0.25, 1.75, features)

    def draw(n):
        y = rng.integers(0, classes, n)
        x = (means[y] + noise * rng.standard_normal((n, features))) * scale
        return x.astype(np.float32), y

    x_train, y_train = draw(n_train)
    x_test, y_test = draw(n_test)
    return Data(x_train, y_train, x_test, y_test)


def init_params(seed: int, features: int, hidden: int, classes: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "W1": (rng.standard_normal((features, hidden)) * np.sqrt(2 / features)).astype(
            np.float32),
        "b1": np.zeros(hidden, np.float32),
        "W2": (rng.standard_normal((hidden, classes)) * np.sqrt(1 / hidden)).astype(
            np.float32),
        "b2": np.zeros(classes, np.float32),
    }


def forward(params: dict, x: np.ndarray):
    h = np.maximum(x @ params["W1"] + params["b1"], 0.0)
    return h, h @ params["W2"] + params["b2"]


def gradients(params: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """Mean softmax cross-entropy over the batch and its gradients (float32)."""
    h, logits = forward(params, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1.0
    d /= n
    grads = {"W2": h.T @ d, "b2": d.sum(axis=0)}
    dh = (d @ params["W2"].T) * (h > 0)
    grads["W1"] = x.T @ dh
    grads["b1"] = dh.sum(axis=0)
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def accuracy(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(params, x)[1].argmax(axis=1) == y).mean())


def switch_counters(switch) -> dict:
    """Priority drops (all ports) and the job-0 counters, through the control path."""
    ctl = SwitchControl(switch)
    try:
        c = ctl.counters(jobs=[0])
    finally:
        ctl.close()
    return {"drop_priority": sum(p["drop_priority"] for p in c["ports"].values()),
            **c["jobs"][0]}


def train(switch=None, *, workers: int = 4, steps: int = 100, batch: int = 32,
          lr: float = 0.05, momentum: float = 0.9, hidden: int = 160, loss_budget: float = 0.0,
          drop_classes=(), data: Data | None = None, seed: int = 0,
          priorities: dict | None = None, timeout: float = 30.0) -> dict:
    """Train with `workers` in-process workers through `switch` (a new golden model by
    default). Returns the test accuracy, the last training loss, and what the switch and
    the workers counted: contributions sent, priority drops and their fraction, lost
    contributions, chunks scaled up or filled in, and the run's seconds."""
    if switch is None:
        from netagg.sim.golden import GoldenSwitch
        switch = GoldenSwitch()
    data = make_data(seed) if data is None else data
    priorities = dict(PRIORITIES if priorities is None else priorities)
    features, classes = data.x_train.shape[1], int(data.y_train.max()) + 1
    if drop_classes:
        ctl = SwitchControl(switch)
        ctl.write([(R.drop_threshold(c), 0) for c in drop_classes])
        ctl.close()
    before = switch_counters(switch)
    session = f"train-{uuid.uuid4().hex}"
    ws = [Worker(r, workers, switch, session=session, timeout=timeout) for r in range(workers)]
    try:
        params = [init_params(seed + 1, features, hidden, classes) for _ in ws]
        velocity = [{k: np.zeros_like(v) for k, v in p.items()} for p in params]
        shards = [np.arange(r, len(data.y_train), workers) for r in range(workers)]
        rngs = [np.random.default_rng(seed + 100 + r) for r in range(workers)]
        names = list(params[0])
        t0 = time.monotonic()
        losses, stats = [], []
        for _ in range(steps):
            handles, step_loss = [], []
            for w, p, shard, rng in zip(ws, params, shards, rngs):
                idx = rng.choice(shard, batch, replace=False)
                loss, g = gradients(p, data.x_train[idx], data.y_train[idx])
                step_loss.append(loss)
                handles.append(w.allreduce_async(
                    [g[k] for k in names], op="mean", loss_budget=loss_budget,
                    priority=[priorities[k] for k in names]))
            for h, p, v in zip(handles, params, velocity):
                for k, g in zip(names, h.wait()):
                    v[k] = momentum * v[k] + g
                    p[k] -= lr * v[k]
            stats.append(handles[0].stats())
            losses.append(float(np.mean(step_loss)))
        seconds = time.monotonic() - t0
        for p in params[1:]:
            for k in names:
                if not np.array_equal(p[k], params[0][k]):
                    raise AssertionError(f"the workers' {k} differ: their results differed")
        counters = [w.counters() for w in ws]
    finally:
        for w in ws:
            w.close()
    after = switch_counters(switch)
    sent = sum(c["packets_sent"] for c in counters)
    dropped = after["drop_priority"] - before["drop_priority"]
    return {
        "workers": workers, "steps": steps, "batch": batch, "loss_budget": loss_budget,
        "drop_classes": list(drop_classes),
        "parameters": sum(v.size for v in params[0].values()),
        "chunks_per_step": sum(s["chunks"] for s in stats[0]),
        "droppable_per_step": sum(s["droppable"] for s in stats[0]),
        "test_accuracy": accuracy(params[0], data.x_test, data.y_test),
        "train_loss": float(np.mean(losses[-10:])),
        "contributions_sent": sent,
        "droppable_sent": sum(c.get("droppable_sent", 0) for c in counters),
        "drop_priority": dropped,
        "drop_fraction": dropped / sent if sent else 0.0,
        "lost_contributions": counters[0].get("lost_contributions", 0),
        "rescaled_chunks": counters[0].get("rescaled_chunks", 0),
        "filled_chunks": counters[0].get("filled_chunks", 0),
        "drop_credit": after["drop_credit"] - before["drop_credit"],
        "seconds": seconds,
    }
