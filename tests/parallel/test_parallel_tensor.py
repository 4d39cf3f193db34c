"""Tensor parallelism is exact: a model split over 2 tp ranks equals one-process transformers.

Each gloo rank builds the same tiny model (fixed seed, fp32), keeps one copy as the oracle and cuts
the other into two pipeline stages (embedding + the first half of the layers; the rest + norm +
head), splits both stages with :func:`stage_tp_plan` / :func:`apply_tp` and runs them one after the
other as the pipeline would: the hidden states cross the boundary as a detached plain tensor, the
last stage hands its final hidden states to the vocab-parallel loss. Logits, the summed loss and
every parameter's gradient must equal the oracle's within 1e-5, with and without sequence
parallelism; each split parameter's local tensor must be exactly the slice :func:`local_slice` names.
A third copy is split on the meta device and filled from each rank's slices only (the loader's way,
:func:`as_dtensor`), then run under sequence parallelism, full activation checkpointing and the
chunked head loss (hfpipe.loss.chunked with its cross entropy swapped for the vocab-parallel one).

Also here: the vocab-parallel loss alone against ``F.cross_entropy(reduction="sum")`` (targets on
both ranks' halves, ignored positions, an all-ignored row), and the refusals. The default suite runs
Llama; ``pytest -m slow`` adds every other family of ``TP_FAMILIES`` (Qwen3: q/k norms; Qwen3-MoE: fused
experts; DeepSeek-V3: MLA), a tied Llama as one stage and a sequence length tp does not divide.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from _dist import run_ranks

TOL = 1e-5
TP = 2
LAYERS = 4
BATCH, SEQ = 2, 16


def _init_tp():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))


def _stages(model, config):
    """The model cut in two stages (same modules, full names), as hfpipe's pipeline builds them; a
    tied model stays one stage, so that its embedding and head share one split weight."""
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.stage import PipelineStageModule
    from hfpipe.models.spec import StageSpec

    half = 0 if config.tie_word_embeddings else LAYERS // 2
    specs = [StageSpec(index=0, layers=tuple(range(half)), embed=True, head=False),
             StageSpec(index=1, layers=tuple(range(half, LAYERS)), embed=False, head=True)]
    if config.tie_word_embeddings:
        specs = [StageSpec(index=0, layers=tuple(range(LAYERS)), embed=True, head=True)]
    return [PipelineStageModule(s, config, model, adapter_for(config)) for s in specs]


def _batch(vocab: int, seq: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, seq), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)  # shifted, as the pipeline's
    targets[0, :5] = -100  # a masked prompt
    ids[1, -3:] = 0  # padding: the embedding's padding row gets no gradient
    return ids, targets


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_worker(kind: str, seq: int = SEQ) -> dict:
    """Max |tp - one process| of logits, loss and grads: split from the whole model, without and with
    sequence parallelism; and split on the meta device, then filled from each rank's slices (the
    loader's way), under sequence parallelism, activation checkpointing and the chunked head loss."""
    from transformers import AutoModelForCausalLM

    from hfpipe.models.meta import build_meta_model
    from hfpipe.tiny import tiny_config

    mesh = _init_tp()
    config = tiny_config(kind, num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).float()
    ids, targets = _batch(config.vocab_size, seq)
    ref_logits = ref(input_ids=ids).logits
    tokens = (targets != -100).sum()  # the pipeline divides the summed loss by the token count
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    oracle = (ids, targets, tokens, ref_logits, ref_loss, ref_params)
    checkpoint = {**ref_params, **dict(ref.named_buffers())}
    out = {}
    for sp in (False, True):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        out[("whole", sp)] = _run(_split(_stages(model, model.config), mesh, sp), mesh, oracle)
    stages = _split(_stages(build_meta_model(config), config), mesh, True)
    for stage in stages:  # and every layer recomputed in backward (the hooks run twice)
        stage.train()
        stage.activation_checkpointing = "full"
    out[("meta", True)] = _run(_fill(stages, checkpoint, mesh), mesh, oracle, chunked=True)
    for r in out.values():
        r["vocab"] = config.vocab_size
    return out


def _split(stages, mesh, sp: bool):
    from hfpipe.parallel.tensor import apply_tp

    apply_tp(stages, mesh, sequence_parallel=sp)  # each stage by its stage_tp_plan
    return stages


def _fill(stages, whole: dict, mesh):
    """Materialise meta stages with this rank's slices of ``whole`` only, as a tp loader does."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from hfpipe.parallel.tensor_slices import as_dtensor, local_slice
    from hfpipe.models.stage import rebuild_buffers

    rank = mesh.get_local_rank()
    for stage in stages:
        stage.to_empty(device="cpu")
        loaded = {}  # id of the meta parameter -> its loaded one: a tied weight is loaded once
        for name, p in list(stage.named_parameters(remove_duplicate=False)):
            if id(p) not in loaded:
                value = whole[name].detach().clone()
                if isinstance(p, DTensor):
                    (placement,) = p.placements
                    value = as_dtensor(local_slice(value, placement, rank, TP).clone(), mesh, placement, p.shape)
                loaded[id(p)] = nn.Parameter(value)
            owner, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(owner), leaf, loaded[id(p)])
        kept = stage.state_dict().keys()  # persistent buffers (DeepSeek's e_score_correction_bias) load too
        for name, buffer in stage.named_buffers():
            if name in kept:
                buffer.copy_(whole[name])
        rebuild_buffers(stage, torch.device("cpu"))
    return stages


def _chunked_vocab_parallel_loss(logits_fn, hidden, targets, tokens):
    """The pipeline's chunked head loss itself: it takes vocabulary-split logits as they come."""
    from hfpipe.loss.chunked import chunked_loss_sum

    return chunked_loss_sum(logits_fn, hidden, targets, 5, float(tokens))


def _run(stages, mesh, oracle, chunked: bool = False) -> dict:
    """Logits, then a loss step through the two stages as the pipeline runs them; diffs to the oracle."""
    from hfpipe.parallel.tensor import param_layouts
    from hfpipe.loss.tokens import IGNORE_INDEX
    from hfpipe.loss.vocab_parallel import vocab_parallel_loss_sum
    from hfpipe.parallel.tensor_slices import local_slice

    ids, targets, tokens, ref_logits, ref_loss, ref_params = oracle
    last = stages[-1]
    seen = []  # tokens a norm inside a layer runs on: 1/tp of them under sequence parallelism
    norm = last.model.layers[str(LAYERS - 1)].input_layernorm
    norm.register_forward_hook(lambda _m, _a, o: seen.append(_local(o).shape[1]))
    with torch.no_grad():
        logits = ids
        for stage in stages:
            logits = stage(logits)
    x, sends = ids, []
    for stage in stages[:-1]:
        h = stage(x)
        x = h.detach().requires_grad_()  # what crosses the pipeline boundary
        sends.append((h, x))
    last.head_in_loss = True
    hidden = last(x)
    if chunked:  # the chunked head loss with its cross entropy swapped for the vocab-parallel one
        loss = _chunked_vocab_parallel_loss(last.logits, hidden, targets, tokens)
    else:
        loss = vocab_parallel_loss_sum(last.logits(hidden), targets, IGNORE_INDEX) / tokens
    loss.backward()
    for h, x in reversed(sends):
        h.backward(x.grad)
    grads, slices = 0.0, 0.0
    for stage in stages:
        for name, (placement, _shape) in param_layouts(stage).items():
            local = stage.get_parameter(name).to_local()
            want = local_slice(ref_params[name], placement, mesh.get_local_rank(), TP)
            slices = max(slices, (local - want).abs().max().item())
        for name, p in stage.named_parameters():
            grads = max(grads, (_full(p.grad) - ref_params[name].grad).abs().max().item())
    return {"plain": {type(t).__name__ for t in (*(h for h, _ in sends), hidden, logits)},
            "logits": (logits - ref_logits).abs().max().item(),
            "loss": abs(loss.item() - ref_loss.item()), "grads": grads, "slices": slices,
            "split": sum(len(param_layouts(s)) for s in stages), "norm_tokens": seen,
            "embed_grad": tuple(_local(stages[0].model.embed_tokens.weight.grad).shape)}


def _check(results: dict, seq: int = SEQ) -> None:
    print({rank: {sp: {k: r[k] for k in ("logits", "loss", "grads")} for sp, r in res.items()} for rank, res in results.items()})
    for rank, res in results.items():
        for (how, sp), r in res.items():
            where = f"rank {rank}, {how} split, sequence_parallel={sp}"
            assert r["plain"] == {"Tensor"}, f"{where}: a DTensor left a stage: {r['plain']}"
            assert r["split"] > 0, where
            assert r["embed_grad"][0] == r["vocab"] // TP, f"{where}: each rank keeps its rows' gradient only"
            mine = len(range(seq)[rank * -(-seq // TP):][:-(-seq // TP)])  # torch.chunk's share
            assert set(r["norm_tokens"]) == {mine if sp else seq}, f"{where}: {r['norm_tokens']}"
            assert r["slices"] == 0.0, f"{where}: a local tensor is not the slice local_slice names"
            for key in ("logits", "loss", "grads"):
                assert r[key] <= TOL, f"{where}: {key} differ by {r[key]:.2e}"


def test_llama_split_over_two_tp_ranks_equals_one_process():
    _check(run_ranks(_tp_worker, TP, "llama"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_tied", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_family_split_over_two_tp_ranks_equals_one_process(kind):
    _check(run_ranks(_tp_worker, TP, kind))


@pytest.mark.slow
def test_a_sequence_that_tp_does_not_divide_is_split_exactly_too():
    _check(run_ranks(_tp_worker, TP, "llama", 15), 15)  # rank 0 holds 8 tokens, rank 1 holds 7


def _loss_worker() -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from hfpipe.loss.vocab_parallel import vocab_parallel_loss_sum

    mesh = _init_tp()
    g = torch.Generator().manual_seed(2)
    vocab = 10
    logits = torch.randn(3, 4, vocab, generator=g) * 5
    targets = torch.tensor([[0, 9, 4, 5], [-100, -100, -100, -100], [7, -100, 2, 1]])  # both halves
    ref = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction="sum")
    ref_loss.backward()
    split = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
    loss = vocab_parallel_loss_sum(split, targets, -100)
    loss.backward()
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": (split.grad.full_tensor() - ref.grad).abs().max().item(),
            "value": loss.item()}


def test_vocab_parallel_loss_equals_summed_cross_entropy():
    results = run_ranks(_loss_worker, TP)
    assert results[0]["value"] == results[1]["value"]  # the same loss on every tp rank
    for rank, r in results.items():
        assert r["loss"] <= TOL and r["grad"] <= TOL, f"rank {rank}: {r}"


def test_the_vocab_parallel_loss_finds_its_slice_where_the_loader_cut_it():
    """The loss takes a rank's first vocabulary id from the DTensor's rule, the loader cuts by ``shard_ranges``:
    the same start for every vocabulary, tp size and rank, uneven splits included."""
    from torch.distributed.tensor import Shard

    from hfpipe.parallel.tensor_slices import shard_ranges

    for vocab in range(1, 40):
        for tp in range(1, 9):
            for rank in range(tp):
                (start, _), = shard_ranges((vocab,), Shard(0), rank, tp)[1]
                assert Shard.local_shard_size_and_offset(vocab, tp, rank)[1] == start, (vocab, tp, rank)


def test_heads_that_do_not_divide_are_refused_in_one_line():
    from hfpipe.errors import HfpipeError
    from hfpipe.parallel.tensor_plan import stage_tp_plan
    from hfpipe.tiny import tiny_config

    config = tiny_config("llama", num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(HfpipeError, match=r"^--tp 2: llama has num_key_value_heads=1, which 2 tp ranks cannot "
                                          r"split evenly; the --tp this model takes: 1$"):
        stage_tp_plan(config, ["lm_head"], False, 2)


def test_a_family_without_a_checked_plan_is_refused_in_one_line():
    from hfpipe.errors import HfpipeError
    from hfpipe.parallel.tensor_plan import stage_tp_plan
    from hfpipe.tiny import tiny_config

    with pytest.raises(HfpipeError, match=r"^--tp 2: tensor parallelism is not checked exact for 'deepseek_v2' "
                                          r"\(checked: .*\); run it with --tp 1$"):
        stage_tp_plan(tiny_config("deepseek_v2"), ["lm_head"], False, 2)


def test_under_ep_the_routed_experts_are_left_out_of_the_tp_plan_and_the_rest_is_split_as_without():
    """``--ep`` shards the routed experts whole over ep ranks (each tp rank dispatches its slice of the tokens):
    the experts get no tp style; attention, the shared expert and the sequence-parallel MoE block keep theirs."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from hfpipe.parallel.tensor_plan import stage_tp_plan
    from hfpipe.tiny import tiny_config

    config = tiny_config("deepseek_v3", num_hidden_layers=3)
    layer = "model.layers.2"
    names = [layer, f"{layer}.self_attn", f"{layer}.self_attn.q_b_proj", f"{layer}.self_attn.o_proj",
             f"{layer}.mlp", f"{layer}.mlp.experts", f"{layer}.mlp.shared_experts.gate_proj",
             f"{layer}.mlp.shared_experts.down_proj", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    split = stage_tp_plan(config, names, True, 2)
    whole = stage_tp_plan(config, names, True, 2, experts_whole=True)
    assert f"{layer}.mlp.experts" in split and f"{layer}.mlp.experts" not in whole
    # without --ep the router reads the block's DTensor input too (its input gradient joins the block's one sum);
    # under --ep the MoE block runs transformers' all-to-all on plain tensors and the router stays whole
    assert set(split) - set(whole) == {f"{layer}.mlp.experts", f"{layer}.mlp.gate"}
    assert all(type(whole[n]) is type(split[n]) for n in whole)
    assert isinstance(whole[f"{layer}.mlp"], PrepareModuleInputOutput)  # the tokens gathered before the router
