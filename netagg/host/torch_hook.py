"""A DDP communication hook that averages each gradient bucket through the switch, every
parameter's gradient in its own priority class, with an optional loss budget.

    model = DistributedDataParallel(model)                     # in a "netagg" group
    netagg.host.torch_hook.register(model, loss_budget=0.05)

Priorities follow DLCP: the switch drops the chunks that matter least first, so the classes
rise with what a lost chunk would cost. `dlcp_priorities`: weight tensors (2 dimensions or
more) in `WEIGHT_CLASSES`, rising with depth (the order of `model.parameters()`: the first
layer's lowest, the last layer's highest, evenly between), and every bias and norm
parameter (1 dimension or fewer, small and on every output) in `BIAS_CLASS`; exponent
messages are the worker's class 7. A `priorities` mapping (parameter name -> class 0..7)
overrides it per parameter.

Each bucket's flat buffer is cut into its parameters' gradients (views, in the bucket's
order) and allreduced as one step, op "mean", each with its class and `loss_budget`: each
worker may have the floor(loss_budget x chunks) smallest chunks of each gradient dropped by
a congested switch, sent in classes below the gradient's (`host.worker`); a gradient of
fewer than 1 / loss_budget chunks of 255 values has none to lose. The future returns the
averaged buffer in place, as DDP expects. A CUDA bucket goes the same way, staged through
pinned host memory (`host.torch_staging`: a gradient longer than a staging chunk is sent in
pieces of whole exponent blocks, each with the gradient's class and loss budget, so its
droppable chunks are counted per piece). A bucket the switch cannot carry (float64, a group
that does not use the switch) falls back to torch's own allreduce hook, through gloo.

Cost: none beyond the allreduce; a CPU bucket is neither copied nor divided on the host.

(No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.)
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from netagg.host.torch_backend import NetaggProcessGroup
from netagg.host.torch_tensors import switch_op

WEIGHT_CLASSES = (3, 4, 5)      # weights, first layers lowest
BIAS_CLASS = 6                  # biases and norms


def dlcp_priorities(model: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> priority class: weights by depth, biases above them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [n for n, p in named if p.dim() > 1]
    out = {n: BIAS_CLASS for n, p in named if p.dim() <= 1}
    top = len(WEIGHT_CLASSES) - 1
    for i, n in enumerate(weights):       # first layer lowest, last layer the top class
        out[n] = WEIGHT_CLASSES[round(top * i / (len(weights) - 1)) if len(weights) > 1
                                else top]
    return out


@dataclasses.dataclass
class HookState:
    """What the hook needs: the group, each parameter's class (by the parameter's identity)
    and the loss budget."""

    group: dist.ProcessGroup
    classes: dict[int, int]
    loss_budget: float = 0.0


def netagg_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    params = bucket.parameters()
    sizes = [p.numel() for p in params]
    if (not isinstance(state.group, NetaggProcessGroup) or state.group.worker is None
            or switch_op([buffer], dist.ReduceOp.AVG) is None or sum(sizes) != buffer.numel()):
        return default_hooks.allreduce_hook(state.group, bucket)
    grads = list(buffer.split(sizes))
    classes = [state.classes[id(p)] for p in params]
    done = state.group.switch_allreduce(grads, "mean", loss_budget=state.loss_budget,
                                        priority=classes)
    return done.then(lambda f: (f.value(), buffer)[1])


def register(model: torch.nn.parallel.DistributedDataParallel, loss_budget: float = 0.0,
             priorities: dict[str, int] | None = None) -> HookState:
    """Register `netagg_hook` on a DDP model (of the "netagg" default group, or the group
    DDP was given) with DLCP classes, updated by `priorities`; returns the hook's state."""
    if not 0.0 <= loss_budget < 1.0:
        raise ValueError(f"loss_budget must be in [0, 1), not {loss_budget}")
    by_name = dlcp_priorities(model.module) | dict(priorities or {})
    classes = {id(p): by_name[n] for n, p in model.module.named_parameters() if n in by_name}
    group = model.process_group if model.process_group is not None else dist.group.WORLD
    state = HookState(group, classes, loss_budget)
    model.register_comm_hook(state, netagg_hook)
    return state
