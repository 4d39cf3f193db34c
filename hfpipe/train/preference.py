"""``hfpipe finetune --method dpo`` around the training loop: the objective, the stored reference pass, the batches.

Before the first step every rank hands its pipeline TRL's DPO loss (:class:`hfpipe.loss.preference.Preference`)
and the pairs get their reference log-probs: a fresh run computes them with a forward-only pass of the
pipeline itself, which is still the reference then (:func:`hfpipe.train.reference.reference_logps`; under
``--lora-rank`` with the adapters switched off, the base PEFT and TRL take as the reference), each dp replica
on its share of the pairs, and rank 0 stores them in the run folder (:data:`REFERENCE_FILE`, safetensors:
never pickle). A resumed run reads them back instead (the weights are no longer the reference), and refuses a
file whose bytes or whose pairs differ from what it was written for. The pairs then carry them as TRL's
``ref_chosen_logps``/``ref_rejected_logps`` columns, and each batch is TRL's collated batch as the pipeline
takes it (:func:`hfpipe.loss.preference.pair_batch`: whole pairs per microbatch).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from hfpipe.checkpoint.dcp import read_meta, resolve_resume
from hfpipe.config.preference import parse_dpo_loss
from hfpipe.data.preference import REF_COLUMNS, REFERENCE_FILE, collate_pairs, iterate_pairs, pairs_digest
from hfpipe.errors import CheckpointError
from hfpipe.loss.preference import REWARD_METRICS, Preference, PreferenceConfig, pair_batch
from hfpipe.train.reference import reference_logps

__all__ = ["pair_metrics", "preference_batches", "prepare_preference", "read_reference", "reward_means",
           "shared_pair_sums", "store_reference", "trl_pad_id"]

log = logging.getLogger(__name__)

_FORMAT = "hfpipe-reference-logps-1"


def prepare_preference(cfg, pm, pairs, pad_id: int):
    """Hand ``pm`` the DPO objective and return ``pairs`` with their reference log-probs (see the module docstring).

    Every rank calls it with the same pairs (``pad_id``: what TRL pads with, :func:`trl_pad_id`). Returns the pairs
    and the record a checkpoint keeps of the file.
    """
    types, weights = parse_dpo_loss(cfg.dpo_loss)
    pm.pipe.use_objective(Preference(PreferenceConfig(beta=cfg.beta, loss_type=tuple(types),
                                                      loss_weights=tuple(weights))))
    path = Path(cfg.output_dir) / REFERENCE_FILE
    digest = pairs_digest(pairs)
    resumed = resolve_resume(cfg.resume, cfg.output_dir)
    if resumed is not None:
        chosen, rejected, record = read_reference(path, digest, len(pairs))
        saved = read_meta(resumed).get("reference") or {}
        if saved.get("xxh3_64", record["xxh3_64"]) != record["xxh3_64"]:
            raise CheckpointError(f"{path} is not the file of reference log-probs --resume {resumed} trained "
                                  "against (another run's?); resume in that run's own --output-dir")
        log.info("read the reference log-probs of %d pairs from %s", len(pairs), path)
    else:
        chosen, rejected = _reference_pass(cfg, pm, pairs, pad_id)
        record = _write(pm, path, chosen, rejected, digest, "base without adapters" if pm.lora else cfg.model)
    for name, values in zip(REF_COLUMNS, (chosen, rejected)):
        pairs = pairs.add_column(name, values.tolist())
    return pairs, record


def _reference_pass(cfg, pm, pairs, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's reference log-probs: each dp replica runs its contiguous share, then they are gathered."""
    d = pm.dist
    share = -(-len(pairs) // d.dp)
    mine = list(range(d.dp_rank * share, min((d.dp_rank + 1) * share, len(pairs))))
    # every replica runs as many batches of as many pairs: FSDP2 gathers each step's weights over the replicas
    # (the preflight's one global batch leaves every replica some pairs; the last one is repeated to fill)
    mine += [mine[-1]] * (share - len(mine))
    chosen, rejected = reference_logps(pm, _in_order(pairs.select(mine), cfg, pad), adapters_off=pm.lora is not None)
    both = torch.stack([chosen, rejected]).to(torch.float32)
    if d.dp > 1:
        parts = [torch.zeros_like(both, device=d.device) for _ in range(d.dp)]
        dist.all_gather(parts, both.to(d.device), group=d.mesh.get_group("dp"))
        both = torch.cat([p.cpu() for p in parts], dim=1)
    return both[0, :len(pairs)].clone(), both[1, :len(pairs)].clone()


def _in_order(pairs, cfg, pad: int):
    """``pairs`` in their order, ``batch_size`` at a time (the last batch may be short), as TRL batches them."""
    for start in range(0, len(pairs), cfg.batch_size):
        part = pairs[start:start + cfg.batch_size]
        rows = [dict(zip(part, values)) for values in zip(*part.values())]
        yield collate_pairs(rows, pad_id=pad, seq_len=cfg.seq_len, multiple=_multiple(cfg))


def _write(pm, path: Path, chosen, rejected, digest: str, reference: str) -> dict:
    """Rank 0 stores the file (:func:`store_reference`); every rank waits, and returns its record."""
    record = store_reference(path, chosen, rejected, digest, reference, write=pm.dist.rank == 0)
    if pm.dist.rank == 0:
        log.info("stored the reference log-probs of %d pairs in %s", len(chosen), path)
    dist.barrier()
    return record


def store_reference(path: Path, chosen, rejected, digest: str, reference: str, *, write: bool = True) -> dict:
    """Write the reference log-probs to ``path`` whole (a hidden sibling renamed into place), with their
    checksum and the digest of the pairs they are for; return that record (also without ``write``)."""
    from safetensors.torch import save_file

    tensors = {"chosen": chosen.to(torch.float32).contiguous(), "rejected": rejected.to(torch.float32).contiguous()}
    record = {"file": path.name, "pairs": len(chosen), "data_xxh3_64": digest, "xxh3_64": _checksum(tensors),
              "reference": reference}
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        hidden = path.with_name(f".{path.name}.partial")
        save_file(tensors, str(hidden), metadata={"format": _FORMAT, **{k: str(v) for k, v in record.items()}})
        os.replace(hidden, path)
    return record


def read_reference(path: Path, digest: str, pairs: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The stored reference log-probs, checked against their checksum and against the pairs they are for.

    Raises:
        CheckpointError: the file is missing, damaged, or was written for other data.
    """
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a resumed --method dpo run reads the reference log-probs its "
                              "first start stored there; start the run afresh in another --output-dir")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in ("chosen", "rejected")}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}); start the run afresh in another "
                              "--output-dir") from None
    if meta.get("format") != _FORMAT or meta.get("xxh3_64") != _checksum(tensors):
        raise CheckpointError(f"{path}: its bytes differ from what was stored (damaged); start the run afresh in "
                              "another --output-dir")
    if meta.get("data_xxh3_64") != digest or int(meta.get("pairs", -1)) != pairs:
        raise CheckpointError(f"{path} holds the reference log-probs of {meta.get('pairs')} other pairs, not of "
                              f"these {pairs}: the data or its tokenisation changed since the run started; resume "
                              "with the same data, or start afresh in another --output-dir")
    record = {"file": path.name, "pairs": pairs, "data_xxh3_64": digest, "xxh3_64": meta["xxh3_64"],
              "reference": meta.get("reference")}
    return tensors["chosen"], tensors["rejected"], record


def _checksum(tensors: dict) -> str:
    import xxhash  # a dependency of datasets, declared by hfpipe too

    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def preference_batches(cfg, pm, pairs, pad_id: int):
    """The loop's batches of one epoch from ``start``: this dp rank's TRL batches as the pipeline takes them."""
    def epoch_batches(epoch: int, start: int):
        for collated in iterate_pairs(pairs, batch_size=cfg.batch_size, seed=cfg.seed, epoch=epoch,
                                      dp_rank=pm.dist.dp_rank, dp_size=pm.dist.dp, start=start, pad_id=pad_id,
                                      seq_len=cfg.seq_len, multiple=_multiple(cfg)):
            yield pair_batch(collated, pm.pipe.microbatches)

    return epoch_batches


def pair_metrics(pm, batches: list[dict]) -> dict[str, float]:
    """TRL's reward metrics of a step's ``batches`` (each the mean over the step's pairs on every dp replica),
    the same on every rank."""
    return reward_means(shared_pair_sums(pm, sum(b["input_ids"].shape[0] for b in batches)))


def shared_pair_sums(pm, rows: int, extra: tuple[float, ...] = ()) -> torch.Tensor:
    """The sums of :data:`REWARD_METRICS` over the objective's records of its last ``rows`` rows, then their
    pairs, then ``extra`` (this replica's own values), all in float64: summed over dp on the loss rank and sent
    along the pipeline, so every rank holds the same. The CLI's step and ``PipelineDPOTrainer``'s log share it.
    cp ranks of a replica hold the same pairs, so the sum is over dp only (preference training refuses cp)."""
    n = len(REWARD_METRICS)
    sums = torch.zeros(n + 1 + len(extra), dtype=torch.float64)
    if pm.pipe.has_loss:
        sums[n + 1:] = torch.tensor(extra, dtype=torch.float64)
        for record in pm.pipe.objective.take(rows):
            sums[n] += record["pairs"]
            sums[:n] += torch.tensor([record.get(k, 0.0) for k in REWARD_METRICS], dtype=torch.float64)
    d, t = pm.dist, sums.to(pm.dist.device)
    if d.dp > 1 and pm.pipe.has_loss:
        dist.all_reduce(t, group=d.mesh.get_group("dp"))
    if d.pp > 1:
        dist.broadcast(t, src=d.pp_peer(pm.loss_rank), group=d.pp_group)
    return t.cpu()


def reward_means(sums: torch.Tensor) -> dict[str, float]:
    """The metrics' means over the pairs of :func:`shared_pair_sums`' ``sums`` (none when there were none)."""
    n = len(REWARD_METRICS)
    return {k: float(v) for k, v in zip(REWARD_METRICS, sums[:n] / sums[n])} if sums[n] > 0 else {}


def trl_pad_id(tok) -> int:
    """The id TRL's ``DPOTrainer`` pads with: the tokenizer's pad token, else its EOS token."""
    return next(i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None)


def _multiple(cfg) -> int | None:
    """Pad each batch's length to a multiple of tp under sequence parallelism, which splits the sequence."""
    return cfg.tp if cfg.tp > 1 and cfg.sequence_parallel else None
