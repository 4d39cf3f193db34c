"""Export a training checkpoint (torch DCP + ``hfpipe.json``) to a Hugging Face model folder.

The data path: DCP metadata -> a plan on a meta-device model (which tensors, in which groups, under
which exported names, in which shard) -> one decoder layer at a time: read from DCP, revert
transformers' in-memory weight conversions (fused MoE experts -> per-expert keys), cast, write
each tensor to its place in its shard file (hfpipe.export.hf_writer: headers first, from the
plan). Peak memory is about one layer, whatever the model or shard size. Everything is written
into a hidden sibling folder and renamed into place at the end, so ``out`` is either the old folder or a complete new one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import os
import re
import threading
from pathlib import Path

import torch

import hfpipe.export.guard as guard
from hfpipe.export.guard import ExportError
from hfpipe.checkpoint.meta import read_checkpoint_meta, resolve_source
from hfpipe.source.config import meta_model
from hfpipe.export.out_folder import build_folder, locked_out
from hfpipe.export.plan import (
    Group,
    assign_shards,
    cross_check,
    dominant_dtype,
    few,
    flat,
    nbytes,
    plan_groups,
    revert_as_source,
    set_out_dtypes,
)
from hfpipe.checkpoint.safe_metadata import _create_file_view, _DcpReader
from hfpipe.source.folder import INDEX, SINGLE, SourceError, check_shard_names
from hfpipe.source.safetensors_io import DTYPES

__all__ = ["ExportError", "export_checkpoint", "read_checkpoint_meta"]

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                  "float64": "fp64", "double": "fp64"}


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    force: bool = False,
    source: str | Path | None = None,
    progress: bool = True,
    merge: bool = False,
    chat_template: str | Path | None = None,
    quiet: bool = False,
) -> Path:
    """Write the model of a training checkpoint as a folder ``from_pretrained`` loads.

    A LoRA run's checkpoint becomes a PEFT adapter folder, or with ``merge`` the base model with
    the adapters merged (see :mod:`hfpipe.export.adapter`).

    Args:
        ckpt: Checkpoint folder (DCP files + ``hfpipe.json``), from a run at any pp size.
        out: Folder to create; refused if it exists unless ``force``.
        dtype: ``auto`` (each tensor in the source checkpoint's dtype; FP8 sources as bf16) or
            ``bf16``/``fp16``/``fp32``/``fp64``; with ``merge`` also ``fp8`` (:mod:`hfpipe.quant.merged`).
        max_shard_size: Largest shard, bytes or a string like ``"5GB"``/``"300MB"``.
        force: Replace an existing ``out`` (only once the new folder is complete).
        source: The HF folder the run started from, if it moved since training.
        progress: Show a progress bar.
        merge: For a LoRA checkpoint, merge the adapters into the base weights.
        chat_template: A template file the run trained with, written as ``chat_template.jinja``.
        quiet: Log what was exported at DEBUG only: a caller that exports a temporary checkpoint (the
            Python API, the Trainer) says what it wrote in its own words.

    Returns:
        The output folder.
    """
    ckpt, out = Path(os.path.abspath(ckpt)), Path(os.path.abspath(out))  # "a/.." must not hide a parent
    meta = read_checkpoint_meta(ckpt)
    extra = {"chat_template.jinja": Path(chat_template).expanduser()} if chat_template else None
    if "lora" in meta or merge:  # adapters only: PEFT's adapter folder, or merged into the base
        return _export_lora(ckpt, out, meta, merge=merge, force=force, source=source, dtype=dtype, extra=extra,
                            quiet=quiet)
    src = resolve_source(meta, source)
    want = _parse_dtype(dtype)
    max_bytes = _parse_size(max_shard_size)
    with locked_out(out, force, (ckpt, src)):
        try:
            return _export_locked(ckpt, out, meta, src, want, max_bytes, progress, extra, quiet)
        except FileNotFoundError as e:  # the folder (or a data file) went away under the reader
            if Path(e.filename or "").is_relative_to(ckpt) or not ckpt.is_dir():
                raise ExportError(f"checkpoint {ckpt} was deleted while it was being exported (pruned by "
                                  "--keep of a run still training?); export a newer checkpoint, or "
                                  "raise --keep; OUT was left as it was") from None
            raise


def _export_lora(ckpt: Path, out: Path, meta: dict, *, merge: bool, force: bool,
                 source: str | Path | None, dtype: str, extra: dict | None = None, quiet: bool = False) -> Path:
    """A LoRA checkpoint as a PEFT adapter folder, or with ``merge`` as a full HF folder.

    Raises:
        ExportError: not a LoRA checkpoint, adapters that do not fit the base, or a bad ``out``.
    """
    from hfpipe.export.adapter import base_name, is_lora_checkpoint, read_adapters, write_adapter
    from hfpipe.checkpoint.base_record import check_base
    from hfpipe.export.merge import write_merged
    from hfpipe.lora.adapters import config_from_dict

    if not is_lora_checkpoint(meta):
        raise ExportError(f"checkpoint {ckpt} is not a LoRA run's; export it without --merge")
    dtype = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())  # "float64" is "fp64", as for a full export
    if dtype != "auto" and not merge:
        raise ExportError(f"--dtype {dtype} does not apply to a LoRA adapter export: the adapter stays fp32; "
                          "drop --dtype, or add --merge")
    src = resolve_source(meta, source)
    config = config_from_dict(meta["lora"])
    record = {"kind": "merged" if merge else "adapter", "checkpoint": str(ckpt), "step": meta["step"]}
    with locked_out(out, force, (ckpt, src)):
        adapters = read_adapters(ckpt, config, src)
        if merge:
            check_base(meta, src, ckpt)
            nbytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            quant = meta.get("quantize_base")  # a quantized base merges as the run saw it (hfpipe.quant.merged)
            build_folder(out, lambda tmp: write_merged(tmp, src, config, adapters, quant=quant, dtype=dtype), nbytes,
                         record, side_from=src, extra=extra)
        else:
            nbytes = sum(t.nbytes for t in adapters.values())
            build_folder(out, lambda tmp: write_adapter(tmp, config, adapters, base_name(meta, src)), nbytes, record,
                         extra=extra)
    (log.debug if quiet else log.info)("exported the %s of step %d to %s", "merged model" if merge else "adapter",
                                       meta["step"], out)
    return out


def _export_locked(ckpt: Path, out: Path, meta: dict, src: Path, want, max_bytes: int, progress: bool,
                   extra: dict | None, quiet: bool = False) -> Path:
    say = log.debug if quiet else log.info
    cfg_json = guard.source_config_json(src)
    fp8 = _source_quantization(src, cfg_json)
    model = meta_model(src)
    reader = _DcpReader(ckpt, _create_file_view)  # this module's name: None forces dcp.load
    guard.check_data_files(ckpt, reader.metadata)
    src_dtypes = _source_dtypes(src)
    groups = plan_groups(model, reader, ckpt, src_dtypes)  # first: another model is named by its keys
    guard.check_tied(meta, model.config, ckpt, src)  # a tied source would silently drop lm_head
    cross_check([k for g in groups for k in g.out], src_dtypes, model, fp8, src)
    set_out_dtypes(groups, want, src_dtypes or {}, meta["source_dtype"])
    shards = assign_shards(groups, max_bytes)
    say("exporting %s -> %s: %d tensors in %d shard(s)", ckpt, out, len(flat(groups)), len(shards))

    def fill(tmp: Path) -> None:
        _write_weights(tmp, reader, model, groups, shards, progress)
        _write_config(tmp, cfg_json, dominant_dtype(groups), fp8)

    build_folder(out, fill, sum(nbytes(*spec) for spec in flat(groups).values()),
                 {"kind": "model", "checkpoint": str(ckpt), "step": meta["step"]}, side_from=src, extra=extra)
    say("exported step %d to %s", meta["step"], out)
    return out


# --- inputs -----------------------------------------------------------------------------------


def _parse_dtype(dtype: str) -> torch.dtype | None:
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of auto, bf16, fp16, fp32, fp64; fix --dtype")
    return _DTYPES[name]


def _parse_size(size: str | int) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (decimal) / ``"4GiB"`` (binary)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?", str(size).strip().upper())
    if not m or float(m.group(1)) <= 0:
        raise ExportError(f"max_shard_size {size!r} is not a size like '5GB' or '300MB'; fix --max-shard-size")
    base = 1024 if m.group(3) else 1000
    nbytes = int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))
    if nbytes < 1:
        raise ExportError(f"max_shard_size {size!r} is below one byte; fix --max-shard-size (e.g. 5GB)")
    return nbytes


def _source_quantization(src: Path, cfg_json: dict) -> bool:
    """Whether the source is block-FP8 (exported dequantised); other quantisations are refused."""
    quant = cfg_json.get("quantization_config")
    if not quant:
        return False
    if quant.get("quant_method") == "fp8":
        return True
    raise ExportError(
        f"{src / 'config.json'}: quantization {quant.get('quant_method')!r} is not supported; "
        "export supports unquantised and fp8 sources"
    )


def _source_dtypes(src: Path) -> dict[str, torch.dtype | None] | None:
    """The source checkpoint's keys and their stored dtypes (None where a shard is gone), if known."""
    from hfpipe.source.safetensors_io import SafetensorsError, read_header

    weight_map = _source_weight_map(src, INDEX)
    if weight_map is not None:
        pass
    elif (src / SINGLE).is_file():
        weight_map = None
    else:
        return None
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
    dtypes: dict[str, torch.dtype | None] = dict.fromkeys(weight_map or (), None)
    for name in files:
        if not (src / name).is_file():
            log.warning("source shard %s is missing; its tensors keep hfpipe.json's source_dtype", name)
            continue
        try:
            header = read_header(src / name)  # checked totally, nothing trusted
        except SafetensorsError as e:
            raise ExportError(str(e)) from None
        for key, entry in header.items():
            if key != "__data_start__":
                dtypes[key] = DTYPES.get(entry["dtype"])
    return dtypes


# --- writing ----------------------------------------------------------------------------------


def _source_weight_map(src: Path, index: str) -> dict[str, str] | None:
    """The source index's key -> shard map with every shard name checked, or None without an index."""
    path = src / index
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        check_shard_names(path, weight_map)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ExportError(f"{path}: malformed index (no 'weight_map'); re-download the source") from None
    except SourceError as e:
        raise ExportError(str(e)) from None
    return weight_map


def _shard_names(n: int) -> list[str]:
    """``model-0000i-of-0000n.safetensors``, also for n = 1: the layout never depends on the size."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_weights(
    tmp: Path, reader: _DcpReader, model, groups: list[Group], shards: list[list[str]], progress: bool
) -> None:
    """Stream groups into shards: copy or convert each tensor to its place at once.

    Every shard's layout is known from the plan, so its header goes first and no shard is ever
    gathered in memory (hfpipe.export.hf_writer): peak memory is one group. Tensors stored as
    is are copied by the kernel, several files at once (dcp_raw.CopyPool), while this thread plans
    the next groups and converts the others; the bar counts bytes once they are in place.
    """
    from tqdm.auto import tqdm

    from hfpipe.checkpoint.dcp_raw import CopyPool
    from hfpipe.export.hf_writer import ShardWriter

    names, specs = _shard_names(len(shards)), flat(groups)
    total = sum(nbytes(*spec) for spec in specs.values())
    shard_of = {k: i for i, keys in enumerate(shards) for k in keys}
    writers: dict[int, ShardWriter] = {}
    filled: list[ShardWriter] = []  # every tensor handed over; copies may still run
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress) as bar, \
                CopyPool(progress=(update := _locked(bar.update))) as pool:
            for group in groups:
                raw = _raw_group(reader, group)
                items = raw.items() if raw is not None else _convert_group(reader, model, group).items()
                for key, value in items:
                    i = shard_of[key]
                    if i not in writers:
                        writers[i] = ShardWriter(tmp / names[i], {k: specs[k] for k in shards[i]}, pool)
                    w = writers[i]
                    if raw is not None:
                        w.copy(key, value)  # the pool counts the bytes once they are copied
                    else:
                        update(w.write(key, value))
                    if not w.remaining:
                        filled.append(writers.pop(i))
                filled = _close_finished(filled)
                _trim_heap()
            for w in filled:
                w.close()
            filled = []
        if writers:
            raise ExportError(f"shards {sorted(writers)} were left incomplete; a bug")
    finally:  # the pool has stopped: no copy runs into these descriptors any more
        for w in [*writers.values(), *filled]:
            w.fd is not None and os.close(w.fd)
    weight_map = {k: names[i] for i, keys in enumerate(shards) for k in keys}
    params = sum(shape.numel() for shape, _ in specs.values())
    index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _locked(fn):
    """``fn`` one call at a time (a progress bar updated from the copy threads and this one)."""
    lock = threading.Lock()

    def call(*args):
        with lock:
            return fn(*args)

    return call


def _close_finished(filled: list) -> list:
    """Close the filled shards whose copies are done (keeps few files open); the others stay."""
    for w in filled:
        if not w.copying:
            w.close()
    return [w for w in filled if w.fd is not None]


def _raw_group(reader: _DcpReader, group: Group) -> dict | None:
    """Exported key -> raw byte spans in the DCP files, if the whole group can be copied as is.

    That is when transformers converts nothing (same names; renamings and merges change names),
    nothing is cast, and DCP stored each tensor (or its FSDP row blocks) whole
    (hfpipe.checkpoint.dcp_raw). Otherwise the group is read and converted in memory.
    """
    from hfpipe.checkpoint.dcp_raw import raw_spans

    if set(group.out) != set(group.fqns):
        return None
    spans = {}
    for fqn in group.fqns:
        md = reader.metadata.state_dict_metadata["model." + fqn]
        if (tuple(md.size), md.properties.dtype) != (tuple(group.out[fqn][0]), group.out[fqn][1]):
            return None
        spans[fqn] = raw_spans(reader.path, reader.metadata, "model." + fqn, reader.file_view, reader.checksums)
        if spans[fqn] is None:
            return None
    return spans


def _convert_group(reader: _DcpReader, model, group: Group) -> dict[str, torch.Tensor]:
    """Read one group from DCP and return it under the exported names, in the export dtypes.

    A helper of its own so that nothing but the returned tensors outlives it (peak memory).
    """
    converted = revert_as_source(model, {fqn: reader.read("model." + fqn) for fqn in group.fqns}, group.as_is)
    got = {k: tuple(t.shape) for k, t in converted.items()}
    if got != {k: tuple(shape) for k, (shape, _) in group.out.items()}:
        raise ExportError(f"converting {group.fqns[0]} gave {few(got)}, planned {few(group.out)}; a bug")
    return {k: t.to(group.out[k][1]).contiguous() for k, t in converted.items()}


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _trim_heap() -> None:
    """Give freed heap pages back to the OS.

    glibc serves tensors below its (dynamic, up to 32 MB) mmap threshold from the heap and keeps
    them after ``free``, so without this the resident size ratchets up by a shard or so (measured:
    +250 MB on a 1.9 GB Llama with 300 MB shards).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _write_config(tmp: Path, cfg_json: dict, dtype: torch.dtype, fp8: bool) -> None:
    cfg = dict(cfg_json)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    if fp8:
        del cfg["quantization_config"]  # the weights are dequantised now
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
