"""A measured layer's routed experts reached as ``--ep`` reaches them: transformers' all-to-all dispatch, one rank.

Under expert parallelism the run does not call the experts as one process does. transformers' ``AllToAllEP``
(:mod:`hfpipe.parallel.expert`) sorts each (token, expert) pair by expert, sends the rows to the experts' ranks,
runs the experts top-1 on what it received and brings the outputs back, where it keeps them (``top_k x h`` per
token) to weigh them by the routing weights; and a LoRA run's adapters on the expert stacks go through hfpipe's
experts forward (:mod:`hfpipe.models.experts`), which builds one expert's weight at a time and keeps each
expert's input rows and, summing into fp32, an fp32 copy of its outputs (``index_add_`` saves its source).
Measured on the one-process experts instead, a Qwen3-MoE LoRA run at ep2 held 1.13x of the plan.

So the plan runs the layer through the same code: transformers' ``AllToAllEP`` installed by its own
``EpDispatchExpertsParallel`` on the measured stage's experts, with the exchanges of a group of one rank (a
copy, as the collective's result is a new buffer). On average a rank's experts receive as many rows as its
tokens choose (``tokens x top_k``), whichever ranks send them, so one rank's bytes per token are the group's.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

from hfpipe.parallel.expert import stage_ep_plan

__all__ = ["dispatch_experts"]


class _OneRank:
    """The ep and tp meshes of a group of one rank, as much of a ``DeviceMesh`` as the dispatch asks of it."""

    def size(self) -> int:
        return 1

    def get_group(self):
        return None

    def get_local_rank(self) -> int:
        return 0


def _exchange(output, input, group=None):  # all_to_all_single: one rank sends itself everything
    return output.copy_(input)


def _exchange_autograd(input, output_split_sizes, input_split_sizes, group):
    return input.clone()  # a new buffer, differentiable; like the collective, it saves nothing


def dispatch_experts(stage: torch.nn.Module) -> int:
    """Run ``stage``'s routed experts through transformers' all-to-all dispatch on one rank, as ``--ep`` runs them.

    Marks them expert-parallel as transformers' ``MoEParamShard`` does (so PEFT's adapters on their stacks then go
    to hfpipe's experts forward, :func:`hfpipe.lora.experts.attach_expert_adapters`, as in the run), and installs
    the dispatch with transformers' own ``EpDispatchExpertsParallel``. Returns the experts modules dispatched (0: a
    dense model, nothing changed). The backward holds no collective here (the exchanges are copies), so only the
    forward, recomputed ones included, runs under the one-rank collectives.
    """
    import transformers.distributed.expert_parallel as ep

    modules = dict(stage.named_modules())
    experts = [modules[n] for n, style in stage_ep_plan(stage).items() if style == "ep_dispatch_experts"]
    for module in experts:
        module._is_expert_parallel = True
        with _one_rank(ep):
            ep.EpDispatchExpertsParallel().install_forward(module, _OneRank(), tp_mesh=_OneRank(),
                                                           ep_implementation="all_to_all")
        module.forward = functools.partial(_on_one_rank, ep, module.forward)
    return len(experts)


def _on_one_rank(ep, forward, *args, **kwargs):
    with _one_rank(ep):
        return forward(*args, **kwargs)


@contextlib.contextmanager
def _one_rank(ep):
    """transformers' collectives of a group of one rank (``get_process_group_ranks``: the dispatch compares the
    ep and tp groups). transformers has no hook for them: they are module names in its expert_parallel."""
    with mock.patch.object(ep, "all_to_all_single", _exchange), \
            mock.patch.object(ep, "all_to_all_single_autograd", _exchange_autograd), \
            mock.patch.object(ep, "get_process_group_ranks", lambda group: [0]):
        yield
