"""A torch pipeline stage whose set-up keeps the gradients accumulated before it.

torch 2.13's schedules set their stages up on the first ``step()`` and again whenever they are told to
(hfpipe.pipeline.shapes resizes a kept schedule for a new batch shape by asking for that). After every
such set-up the schedule calls each stage's ``_post_metadata_inference_cleanup``, which, for an FSDP2
stage (``--dp`` or ``--cp`` > 1), reshards it and sets every parameter's ``.grad``
to ``None``: it assumes a set-up happens before any training, and clears what its own metadata pass
may have left. But gradient accumulation runs one ``step()`` per accumulation batch, and FSDP2 adds
each one's reduce-scattered gradient into the sharded ``.grad``: an accumulation batch whose shape
sets a schedule up (a new sequence length, a chunked head loss chosen anew, a schedule built) dropped
the gradients of every earlier batch of its optimizer step. This stage puts back, after torch's clean-up,
the gradients its parameters held before the set-up began, and still drops whatever the set-up wrote.
torch has no switch for this; the two methods overridden are those of torch 2.13's ``PipelineStage``.
"""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from hfpipe.parallel.one_replica import one_replica_of

__all__ = ["AccumulatingStage"]


class AccumulatingStage(PipelineStage):
    """A :class:`torch.distributed.pipelining.PipelineStage` whose (re-)set-up leaves ``.grad`` as it found it
    (and which runs bf16-mixed's one-replica casts where torch runs FSDP2's hooks)."""

    def _prepare_forward_infra(self, *args, **kwargs):
        # The first call of every set-up (the schedule prepares the forward before the backward, and a set-up
        # with a backward always prepares both): the gradients of this optimizer step so far.
        if hasattr(PipelineStage, "_post_metadata_inference_cleanup"):
            self._grads_before_setup = [(p, p.grad) for p in self.submod.parameters()]
        return super()._prepare_forward_infra(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        if mixed := one_replica_of(self.submod):
            mixed.discard()
        for p, grad in getattr(self, "_grads_before_setup", ()):
            p.grad = grad
        self._grads_before_setup = []

    # bf16-mixed at one replica (hfpipe.parallel.one_replica) is called where torch calls FSDP2: after each
    # backward that FSDP2's post-backward hooks follow (a full or an input-only one; a weight-only backward
    # leaves its gradients on the bf16 copies, as FSDP2's), and at the step's gradient reduction.
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "weight" and (mixed := one_replica_of(self.submod)):
            mixed.post_backward()
        return result

    def perform_reduce_grad(self, grad_scale_factor: int):
        if mixed := one_replica_of(self.submod):
            mixed.reshard()
        super().perform_reduce_grad(grad_scale_factor)
