"""Helpers for drafter tests: build a drafter on the fixture target and run the target once."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import DraftBatch, Drafter, build_drafter


@dataclass
class Run:
    ids: torch.Tensor  # [B, T]
    hidden: torch.Tensor  # [B, T, n, H]
    last_hidden: torch.Tensor  # [B, T, H]

    def batch(self, **kw) -> DraftBatch:
        return DraftBatch(self.ids, self.hidden, self.last_hidden, **kw)


def make_drafter(target, name: str, **overrides) -> Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(name=name, num_anchors=6, num_layers=overrides.pop("num_layers", 2), **overrides)
    return build_drafter(cfg, target).eval()


def run_target(target, drafter: Drafter, ids: torch.Tensor) -> Run:
    out = target.forward(ids, layer_ids=drafter.layer_ids)
    return Run(ids, out.hidden, out.last_hidden)


@pytest.fixture(scope="module")
def ids(tiny_target) -> torch.Tensor:
    """[2, 20] token ids sampled from the fixture vocabulary (mask/special ids avoided)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(10, tiny_target.vocab_size, (2, 20), generator=gen)


@pytest.fixture(scope="session")
def dr() -> SimpleNamespace:
    """make(target, name, **cfg) → drafter; run(target, drafter, ids) → Run (the target's taps)."""
    return SimpleNamespace(make=make_drafter, run=run_target)
