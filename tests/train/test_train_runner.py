"""What the run loop feeds the model from the data pipeline."""

from __future__ import annotations

import torch

from _dist import tiny_checkpoint
from hfpipe.data.batches import iterate_batches
from hfpipe.data.config import DataConfig
from hfpipe.data.load import load_examples
from hfpipe.data.batches import model_inputs


def test_packed_batches_keep_documents_apart():
    """Packed rows reach the model without a mask, so transformers isolates each document."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint("llama", num_hidden_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    ds = load_examples(DataConfig(dataset="builtin:tiny-text", seq_len=64, packing=True), tok)
    batch = next(iterate_batches(ds, batch_size=2, seed=0, epoch=0))
    inputs = model_inputs(batch, packed=True)
    assert "attention_mask" not in inputs and "position_ids" in inputs
    pos = inputs["position_ids"][0]
    starts = [i for i in range(1, len(pos)) if pos[i] == 0]
    assert starts, "the row must hold more than one document for this test"
    cut = starts[0]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        packed = model(input_ids=inputs["input_ids"][:1], position_ids=inputs["position_ids"][:1],
                       use_cache=False).logits[0]
        alone = model(input_ids=inputs["input_ids"][:1, cut:], use_cache=False).logits[0]
    # the second document sees only itself: its logits equal running it alone
    n = (starts[1] if len(starts) > 1 else len(pos)) - cut
    torch.testing.assert_close(packed[cut:cut + n], alone[:n], atol=1e-5, rtol=0)


def test_unpacked_batches_keep_their_padding_mask():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}
    assert model_inputs(batch, packed=False) is batch


def test_a_scheduler_saved_with_more_parameter_groups_resumes_on_fewer_and_on_more():
    """Optimizer groups follow the layout (one per device mesh under --tp/FSDP2): the LR schedule's state
    is one entry per group, the same for each, and maps onto any other count at the same step."""
    import torch

    from hfpipe.train.optim import build_scheduler, load_scheduler_state

    def scheduler(groups: int):
        opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1e-3)
        return build_scheduler(opt, warmup_steps=2, total_steps=10, lr=1e-3)

    saved = scheduler(4)
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    for groups in (1, 2, 8):
        resumed = scheduler(groups)
        load_scheduler_state(resumed, saved.state_dict())
        resumed.optimizer.step()
        resumed.step()
        saved_next = scheduler(4)
        load_scheduler_state(saved_next, saved.state_dict())
        saved_next.optimizer.step()
        saved_next.step()
        assert resumed.get_last_lr() == [saved_next.get_last_lr()[0]] * groups
        assert resumed.last_epoch == 4
