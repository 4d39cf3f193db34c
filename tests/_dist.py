"""Helpers for tests that run real gloo processes on localhost, build tiny checkpoints and read them."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from hfpipe.parallel.launch import launch

TIMEOUT_S = 300


def caught(fn) -> tuple[str, str] | None:
    """``(class name, message)`` of what ``fn()`` raised, or None: ranks' errors compared as data."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller compares what each rank raised
        return type(e).__name__, str(e)
    return None


def run_ranks(fn, nprocs: int, *args) -> dict[int, object]:
    """Run module-level ``fn(*args)`` in ``nprocs`` spawned processes; return rank -> result."""
    return launch(fn, nprocs, *args, threads_per_rank=1, timeout_s=TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(kind: str, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` (cached for the test session)."""
    from hfpipe.tiny import make_tiny_checkpoint

    out = Path(tempfile.mkdtemp(prefix=f"hfpipe-{kind}-"))
    return make_tiny_checkpoint(out, kind, **overrides)


def folder_tensors(folder) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by key."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out


# --- Comparing trained weights with the oracle's -------------------------------------------------
#: A gradient element may differ from the oracle's by reordered float sums (microbatches, another
#: matmul blocking): at most this many fp32 ulps of the terms it sums (at most 9 seen here, on
#: Llama and DeepSeek-V3 under every schedule).
GRAD_ULPS = 64
FP32_ULP = 2.0 ** -23


def grad_noise(grad: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Per element, how far ``grad`` may move when the same sums run in another order:
    :data:`GRAD_ULPS` fp32 ulps of its :func:`grad_scale`."""
    return GRAD_ULPS * FP32_ULP * grad_scale(grad, vocab)


def grad_scale(grad: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Per element, the size a reordered sum's rounding in ``grad`` is relative to.

    A matrix gradient sums ``dy_i * x_j`` over tokens, and both factors carry rounding relative
    to their own vectors (``dy`` to the largest ``dy_i``, ``x`` to the largest ``x_j``). So the
    noise of element ``(i, j)`` scales with the larger of its row's and its column's largest
    gradient, even where the sum cancels to almost nothing. Rows indexed by the vocabulary
    (``vocab`` of them: embedding, head) take their own row's: a token's softmax probability,
    and its embedding row, are computed to relative precision each. A row no token reached sums
    nothing and stays exactly zero.
    """
    size = grad.abs()
    if grad.ndim >= 2:  # (..., rows, columns): fused experts are one matrix per expert
        row = size.amax(dim=-1, keepdim=True)
        scale = row if grad.shape[-2] == vocab else torch.maximum(row, size.amax(dim=-2, keepdim=True))
    else:
        scale = size.amax() if grad.numel() else size
    return scale


class AdamDrift:
    """Per weight element, how far AdamW may carry a run whose gradients differ by reordering only.

    AdamW steps by ``lr * m̂ / (sqrt(v̂) + eps)``. With every gradient of the history moved by at
    most ``d`` (:func:`grad_noise`, per element), ``m̂`` and ``sqrt(v̂)`` move by at most ``d`` (both are
    weighted means whose weights sum to one) and ``|m̂| <= sqrt(v̂)``, so the step moves by at most
    ``lr * min(2, 2d / (sqrt(v̂) - d + eps))``. That is ~0 for a real gradient and up to ``2 lr``
    for one that is itself rounding noise, whose sign is anyone's. Weight decay only shrinks an
    earlier difference; what an earlier difference changes in later gradients is second order
    (measured: under 5% of the allowance). Call :meth:`step` right after each ``opt.step()`` of
    the oracle.
    """

    def __init__(self, named, vocab: int):
        """``named``: (name, parameter) pairs, a tied parameter under each of its names."""
        self.vocab = vocab
        self.names: dict[int, list[str]] = {}
        for name, p in named:
            self.names.setdefault(id(p), []).append(name)
        self.drift: dict[str, torch.Tensor] = {}

    def step(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:  # lr: the one this step used (before the scheduler's step)
            beta2, eps, lr = group["betas"][1], group["eps"], group["lr"]
            for p in group["params"]:
                if p.grad is None or id(p) not in self.names:
                    continue
                state = opt.state[p]
                rms = (state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))).sqrt()
                d = grad_noise(p.grad, self.vocab)
                bound = lr * (2 * d / (rms - d + eps).clamp(min=eps)).clamp(max=2.0)
                for name in self.names[id(p)]:
                    self.drift[name] = self.drift.get(name, 0.0) + bound


def assert_grads_close(got: dict, want: dict, vocab: int, what: str = "") -> None:
    """Every gradient of ``got`` within :func:`grad_noise` of ``want``'s (the same name)."""
    for name, g in got.items():
        noise = grad_noise(want[name], vocab)
        _assert_within(name, g, want[name], noise, what, f"{GRAD_ULPS} ulps of its row/column's largest")


def assert_weights_close(got: dict, want: dict, drift: dict, atol: float, what: str = "") -> None:
    """Every weight of ``got`` within ``atol`` plus its :class:`AdamDrift` of ``want``'s."""
    for name, w in got.items():
        _assert_within(name, w, want[name], atol + drift.get(name, 0.0), what, f"atol {atol:g} + Adam drift")


def _assert_within(name: str, got: torch.Tensor, want: torch.Tensor, allowed, what: str, why: str) -> None:
    assert got.shape == want.shape, f"{what} {name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().flatten()
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand(want.shape).flatten()
    bad = ~(err <= allowed)  # NaN is beyond every tolerance
    if bad.any():
        i = int(torch.where(bad, (err - allowed).nan_to_num(nan=float("inf")), -1.0).argmax())
        raise AssertionError(f"{what} {name}: {int(bad.sum())} of {err.numel()} elements beyond "
                             f"tolerance; worst [{i}] differs by {float(err[i]):.3g}, allowed "
                             f"{float(allowed[i]):.3g} ({why})")
