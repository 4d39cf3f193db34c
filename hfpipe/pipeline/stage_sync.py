"""FSDP that shards under the pipeline too: reduce-scatter and reshard after every microbatch.

torch's pipeline stage runs every microbatch's backward with FSDP2's gradient sync off and its
resharding off, then reduces once at the end of the step (``perform_reduce_grad``): a rank keeps its
stage's weights gathered and its gradients whole (fp32) for the whole step, about 6 bytes a parameter
that no ``--dp`` removes. With ``--reshard-per-microbatch`` (NeMo AutoModel's
``defer_fsdp_grad_sync=False``) each microbatch's backward reduce-scatters its gradients into the dp
shards and reshards the weights, and each forward reshards after it: weights and gradients then divide
by dp, for one all-gather per forward and backward and one reduce-scatter per backward of each
microbatch. Written here because torch's stage offers no switch for it: the one method that decides
sync is overridden, the backward itself is torch's.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from hfpipe.pipeline.accumulating_stage import AccumulatingStage

__all__ = ["ReducingStage"]


class ReducingStage(AccumulatingStage):
    """A pipeline stage (:class:`~hfpipe.pipeline.accumulating_stage.AccumulatingStage`) whose FSDP2 module
    reduces every microbatch.

    On the last stage the stage's own unit (final norm and head) stays gathered from its forward to its
    backward: the chunked head loss (:mod:`hfpipe.loss.chunked`) runs them after the stage's
    forward, outside it, where resharded weights would be dp shards. It is resharded after each backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_last and isinstance(self.submod, FSDPModule):
            self.submod.set_reshard_after_forward(False, recurse=False)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not isinstance(self.submod, FSDPModule) or backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        from torch.distributed.pipelining.stage import stage_backward

        self.submod.set_is_last_backward(True)  # FSDP2's final callback then runs its post-backward now
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None
