"""An int8 copy of the target's LM head for a drafter's readout, on CPU.

A block drafter reads out γ slots through the target's frozen LM head, [γ, H] × [H, V]. On
CPU that fp32 matrix product can be most of a small drafter's cost (``docs/results.md`` has the
measurements). Drafts need not be exact: the target verifies them with its own fp32 head, so
output stays lossless and only acceptance can change. ``int8_lm_head`` gives the drafter its own
dynamically quantized copy (per-channel int8 weights, int8 activations per call) of its readout
head: the shared LM head, or with a draft vocabulary its reduced head [DV, H] (both savings
multiply); the target's head, the draft head's float weights (checkpoints) and training are
untouched.

The kernels are PyTorch's fbgemm dynamic-quantized linear ops (``torch.ops.quantized``), the
fast int8 path on x86 CPUs in the pinned torch; PyTorch marks quantized tensors deprecated (in
favour of torchao), so this is an opt-in, and a torch without them fails at ``int8_lm_head``
with its own error rather than silently falling back.

Knows nothing about drafter families: it swaps ``drafter.readout_head`` only.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn


class Int8Linear(nn.Module):
    """y = x Wᵀ (+ b) with W int8 per output channel and x quantized per call (CPU only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 drafter head: quantized kernels run on CPU only, the head is on "
                             f"{linear.weight.device}; drop the int8 head option on GPU")
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream (module docstring)
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out] float32
        shape = x.shape
        # reduce_range: 7-bit activations, or fbgemm's int16 pair sums saturate on AVX2
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float().contiguous(), self._packed, True)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def int8_lm_head(drafter: Any) -> Any:
    """Gives ``drafter`` (in place, returned) an int8 copy of its readout head (H → R)."""
    head = drafter.readout_head
    if not isinstance(head, nn.Linear):
        raise TypeError(f"int8 drafter head: the readout head is a {type(head).__name__}, not nn.Linear")
    drafter.use_readout_head(Int8Linear(head))
    return drafter
