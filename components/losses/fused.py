"""α, TV and log q(token) of the default loss in one CPU kernel (``tv_ce.c``), with its backward.

The default DSpark loss (``confidence.tv_ce_confidence_loss``) needs, per draft position over
the readout vocabulary, α = Σ min(p, q), TV = ½ Σ |p − q| and log q at the data token, where p
is the target's softmax and q the drafter's. Through torch that is about a dozen passes over
[N, γ, V] buffers (two softmaxes, a log-softmax, minimum, difference, norm, sign, the upcasts
of bfloat16 logits and their backwards) and on a CPU they cost more than the drafter's own
products (docs/results.md, "Drafter training steps"). The kernel visits each row once while it
is in cache, reads bfloat16 logits as they come from autocast, and keeps q and an int8 sign
for a backward of one pass.

Used where it is declared able to run: CPU tensors, a CPU with AVX2 and FMA and a C compiler
(``target.kernels.why_unavailable``), float32 or bfloat16 logits; elsewhere (GPUs, float64
tests) the callers keep the torch path, which the kernel is tested against
(tests/components/losses/test_fused.py). Built once per machine under ``KERNEL_DIR``. Knows
nothing of masks, weights or reductions.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from components.target.kernels import FLAGS, KernelUnavailable, build_library, why_unavailable

SOURCE = Path(__file__).with_name("tv_ce.c")
KERNEL_DIR = Path("~/.cache/specline/kernels").expanduser()
DTYPES = (torch.float32, torch.bfloat16)
_lib: ctypes.CDLL | None = None


def fused_available(*tensors: Tensor) -> bool:
    """Whether ``fused_tv_ce`` runs for these logits: declared by the CPU, the compiler's
    presence, the tensors' device and dtype (never by trying)."""
    return (why_unavailable() is None and all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors))


def _kernel() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        why = why_unavailable()
        if why:
            raise KernelUnavailable(why)
        lib = ctypes.CDLL(str(build_library(KERNEL_DIR, "tv_ce", [SOURCE], FLAGS)))
        lib.tv_ce_forward.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
                                      + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_int])
        lib.tv_ce_backward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 2
        lib.tv_ce_forward.restype = lib.tv_ce_backward.restype = None
        _lib = lib
    return _lib


class _FusedTVCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, target_logits: Tensor, draft_logits: Tensor, tokens: Tensor,
                temperature: float) -> tuple[Tensor, Tensor, Tensor]:
        lib, shape = _kernel(), draft_logits.shape
        v = shape[-1]
        t = target_logits.detach().reshape(-1, v).contiguous()
        d = draft_logits.detach().reshape(-1, v).contiguous()
        tok = tokens.reshape(-1).to(torch.int64).contiguous()
        rows = d.shape[0]
        q = torch.empty(rows, v, dtype=torch.float32)
        sign = torch.empty(rows, v, dtype=torch.int8)
        out = torch.empty(rows, 4, dtype=torch.float32)
        lib.tv_ce_forward(t.data_ptr(), int(t.dtype == torch.bfloat16), d.data_ptr(), int(d.dtype == torch.bfloat16),
                          tok.data_ptr(), rows, v, 1.0 / temperature, q.data_ptr(), sign.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
        ctx.save_for_backward(q, sign, out[:, 3].contiguous(), tok)
        ctx.shape, ctx.dtype = shape, draft_logits.dtype
        lead = shape[:-1]
        return out[:, 0].reshape(lead), out[:, 1].reshape(lead), out[:, 2].reshape(lead)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_alpha: Tensor, g_tv: Tensor, g_logq: Tensor) -> tuple[None, Tensor, None, None]:
        q, sign, r, tok = ctx.saved_tensors
        coef = torch.stack([0.5 * (g_alpha.reshape(-1) - g_tv.reshape(-1)), g_logq.reshape(-1), r], dim=1)
        coef = coef.float().contiguous()
        grad = torch.empty(q.shape, dtype=ctx.dtype)  # written in the logits' own dtype
        _kernel().tv_ce_backward(q.data_ptr(), sign.data_ptr(), coef.data_ptr(), tok.data_ptr(), q.shape[0], q.shape[1],
                                 grad.data_ptr(), int(ctx.dtype == torch.bfloat16), torch.get_num_threads())
        return None, grad.view(ctx.shape), None, None


def fused_tv_ce(
    target_logits: Tensor,  # [N, γ, V] float32 / bfloat16, a constant
    draft_logits: Tensor,  # [N, γ, V] float32 / bfloat16
    tokens: Tensor,  # [N, γ] long, each in [0, V) (a placeholder at invalid positions)
    temperature: float = 1.0,  # divides the target logits
) -> tuple[Tensor, Tensor, Tensor]:  # α, TV, log q(token): [N, γ] each, float32
    """α and TV of p = softmax(target / T) against q = softmax(draft), and log q at ``tokens``,
    all differentiable w.r.t. the draft logits (``fused_available`` says where it runs)."""
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < draft_logits.shape[-1]:
        raise ValueError(f"fused_tv_ce: tokens must lie in [0, {draft_logits.shape[-1]}), got "
                         f"{int(tokens.min())}..{int(tokens.max())}")
    return _FusedTVCE.apply(target_logits, draft_logits, tokens, temperature)
