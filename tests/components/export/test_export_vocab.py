"""Exports of drafters with a draft vocabulary: ``draft_vocab_size``, the reduced ``lm_head``, and
``d2t`` as vLLM/SGLang read it (int64 offsets: target id = draft id + d2t[draft id]) + ``t2d``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.export import ExportError, export_vllm, sglang_export, vllm_export

DV = 96


def make(target, name, **kw):
    torch.manual_seed(0)
    counts = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3)).double()
    cfg = DrafterConfig(name=name, num_layers=kw.pop("num_layers", 2), draft_vocab_size=DV, **kw)
    return build_drafter(cfg, target, counts)


def check_map(drafter, t: dict[str, torch.Tensor]) -> None:
    d2t, t2d = t["d2t"], t["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DV,)
    assert t2d.dtype == torch.bool and t2d.shape == (drafter.spec.target.vocab_size,)
    ids = torch.arange(DV) + d2t  # the convention vLLM applies: target = draft + d2t[draft]
    assert torch.equal(ids, drafter.vocab.target_ids()) and bool((ids[1:] > ids[:-1]).all())
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert torch.equal(t["lm_head.weight"], drafter.vocab.head.weight.detach())
    assert not any(k.startswith("vocab.") for k in t)


@pytest.mark.parametrize("layout", ["native", "speculators"])
def test_eagle3_writes_d2t(tiny_target, tmp_path, layout):
    d = make(tiny_target, "eagle3")
    path = export_vllm(d, tiny_target, tmp_path / layout, layout=layout)
    config = json.loads((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    layer = config if layout == "native" else config["transformer_layer_config"]
    assert config["draft_vocab_size"] == DV and layer["vocab_size"] == tiny_target.vocab_size
    assert t["lm_head.weight"].shape == (DV, tiny_target.hidden_size)
    check_map(d, t)


@pytest.mark.parametrize("name", ["dflash", "dspark"])
@pytest.mark.parametrize("layout", ["native", "speculators"])
def test_block_drafters_write_d2t_and_their_own_head(tiny_target, name, layout):
    d = make(tiny_target, name, sample_from_anchor=name == "dspark")
    config, t = vllm_export(d, tiny_target, layout)
    assert config["draft_vocab_size"] == DV
    check_map(d, t)
    if name == "dspark":
        assert t["markov_head.markov_w2.weight"].shape == (DV, d.cfg.markov_rank)
        assert t["markov_head.markov_w1.weight"].shape == (tiny_target.vocab_size, d.cfg.markov_rank)


def test_full_vocabulary_exports_are_unchanged(tiny_target):
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig(name="dspark", num_layers=2), tiny_target)
    config, t = vllm_export(d, tiny_target, "speculators")
    assert config["draft_vocab_size"] == tiny_target.vocab_size
    assert not {"d2t", "t2d", "lm_head.weight"} & set(t)  # the head is shared from the target


def test_sglang_writes_the_draft_map(tiny_target):
    d = make(tiny_target, "eagle3")
    config, t = sglang_export(d, tiny_target)
    assert config["draft_vocab_size"] == DV
    check_map(d, t)


def test_medusa_with_a_draft_vocabulary_is_refused(tiny_target):
    with pytest.raises(ExportError, match="token_map"):
        vllm_export(make(tiny_target, "medusa", medusa_heads=2), tiny_target, "native")
