"""Loss tolerance in training: data-parallel SGD through the golden switch, once exact and
once with the switch dropping every droppable packet (priority drop), reaches the same test
accuracy while 1..5 % of the contributions sent were dropped."""

from __future__ import annotations

import time

from netagg.apps.train import make_data, train


def test_training_tolerates_priority_drop_within_the_loss_budget():
    t0 = time.monotonic()
    data = make_data(seed=0)
    exact = train(data=data, seed=0)
    # each worker may lose 5 % of each tensor's chunks: 2 of the first layer's 41 per step
    # (the other tensors are too small to lose one); threshold 0 on the classes below the
    # tensors' priorities makes every one of them a null
    lossy = train(data=data, seed=0, loss_budget=0.05, drop_classes=range(4))
    seconds = time.monotonic() - t0

    assert exact["drop_priority"] == 0 and exact["lost_contributions"] == 0
    assert lossy["droppable_per_step"] == 2
    assert lossy["drop_priority"] == lossy["droppable_sent"] > 0
    assert 0.01 <= lossy["drop_fraction"] <= 0.05, lossy["drop_fraction"]
    assert lossy["rescaled_chunks"] > 0 and lossy["lost_contributions"] > 0
    assert exact["drop_credit"] == lossy["drop_credit"] == 0
    assert exact["test_accuracy"] > 0.8 and lossy["test_accuracy"] > 0.8     # chance: 0.1
    assert abs(exact["test_accuracy"] - lossy["test_accuracy"]) <= 0.005, (
        exact["test_accuracy"], lossy["test_accuracy"])
    print(f"\ntest accuracy {exact['test_accuracy']:.4f} exact, {lossy['test_accuracy']:.4f} "
          f"with {lossy['drop_fraction']:.2%} of {lossy['contributions_sent']} contributions "
          f"dropped ({lossy['parameters']} parameters, {lossy['chunks_per_step']} chunks per "
          f"step, {lossy['steps']} steps, 4 workers), {seconds:.1f} s")
