"""Exported configs and weights checked field by field against the engines' layouts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.drafters.capabilities import Capability
from components.export import (
    ExportError,
    export_sglang,
    export_vllm,
    sglang_export,
    vllm_export,
    vllm_method,
    vllm_speculative_config,
)

LAYER = [
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


def make(target, name, **kw):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(name=name, num_layers=kw.pop("num_layers", 2), **kw), target)


def test_eagle3_vllm_native(tiny_target):
    d = make(tiny_target, "eagle3")  # layers [0, 1, 2] on the 4-layer fixture
    config, t = vllm_export(d, tiny_target, "native")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # inputs of layer i+1
    assert config["target_hidden_size"] == 64 and config["hidden_size"] == 64
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 32)
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    mid = {f"midlayer.{k}" for k in LAYER} | {"midlayer.hidden_norm.weight"}
    assert set(t) == mid | {"fc.weight", "norm.weight", "lm_head.weight"}  # full vocabulary: no d2t/t2d
    assert t["fc.weight"].shape == (64, 3 * 64)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # input 2H
    assert t["midlayer.self_attn.k_proj.weight"].shape == (32, 128)
    assert torch.equal(t["lm_head.weight"], tiny_target.lm_head.weight.detach())
    assert "embed_tokens.weight" not in t and vllm_method(d) == "eagle3"


def test_eagle3_vllm_speculators(tiny_target, tmp_path):
    d = make(tiny_target, "eagle3", ttt_steps=4)
    path = export_vllm(d, tiny_target, tmp_path / "e3", layout="speculators")
    config = json.loads((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"]["name_or_path"] == tiny_target.name_or_path
    assert spec["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 512 and config["norm_before_residual"] is False
    assert {f"layers.0.{k}" for k in LAYER} | {"layers.0.hidden_norm.weight"} <= set(t)
    assert not any(k.startswith("midlayer.") for k in t)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_peagle_vllm_speculators(tiny_target):
    """EAGLE-3's layout as speculators_model_type peagle: mask_hidden as vLLM's [1, n·H] buffer,
    the mask embedding in the draft's own table at the mask token's row; run with parallel drafting."""
    d = make(tiny_target, "peagle", num_layers=1, ttt_steps=4)
    config, t = vllm_export(d, tiny_target, "speculators")
    _, te = vllm_export(make(tiny_target, "eagle3", num_layers=1, ttt_steps=4), tiny_target, "speculators")
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == d.cfg.mask_token_id
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert set(t) == set(te) | {"mask_hidden", "embed_tokens.weight"}
    assert torch.equal(t["mask_hidden"], d.mask_hidden.detach().view(1, -1))
    embed, mask_id = t["embed_tokens.weight"], d.cfg.mask_token_id
    assert torch.equal(embed[mask_id], d.mask_embed.detach())
    others = torch.arange(embed.shape[0]) != mask_id
    assert torch.equal(embed[others], tiny_target.model.get_input_embeddings().weight.detach()[others])
    spec = vllm_speculative_config(d, "/x", 4)
    assert spec == {"method": "eagle3", "model": "/x", "num_speculative_tokens": 4, "parallel_drafting": True}
    with pytest.raises(ExportError, match="speculators layout only"):
        vllm_export(d, tiny_target, "native")


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_block_speculators(tiny_target, name):
    d = make(tiny_target, name, block_size=5)
    config, t = vllm_export(d, tiny_target, "speculators")
    assert config["speculators_model_type"] == name and vllm_method(d) == name
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]  # HF hidden_states indices; vLLM subtracts 1
    assert config["mask_token_id"] == tiny_target.tokenizer.mask_token_id
    assert config["block_size"] == 5 and config["sample_from_anchor"] is (name == "dspark")
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == d.num_speculative_tokens
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    layers = {f"layers.{i}.{k}" for i in range(2) for k in LAYER + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]}
    base = layers | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    heads = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
             "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert set(t) == (base | heads if name == "dspark" else base)
    assert t["fc.weight"].shape == (64, 3 * 64)
    if name == "dspark":
        assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"]) == (32, "vanilla", True)
        assert t["markov_head.markov_w1.weight"].shape == (512, 32)
        assert t["markov_head.markov_w2.weight"].shape == (512, 32)
    else:
        assert "markov_rank" not in config


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_block_native(tiny_target, name):
    d = make(tiny_target, name)
    config, t = vllm_export(d, tiny_target, "native")
    assert config["architectures"] == [{"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[name]]
    assert config["num_target_layers"] == 4 and config["num_hidden_layers"] == 2 and config["block_size"] == 7
    dc = config["dflash_config"]
    assert dc["target_layer_ids"] == [0, 1, 2]  # native ids are outputs of layer i, unchanged
    assert dc["mask_token_id"] == tiny_target.tokenizer.mask_token_id
    assert ("markov_rank" in dc) is (name == "dspark")
    assert dc["sample_from_anchor"] is (name == "dspark")
    if name == "dspark":  # vLLM's Qwen3 DSpark model reads its head fields at the top level
        assert (config["markov_rank"], config["markov_head_type"], config["sample_from_anchor"]) == (32, "vanilla", True)
        assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
        assert config["model_type"] == "qwen3"  # DSparkDraftModel + qwen3 -> vLLM's Qwen3DSparkModel
    else:
        assert "markov_rank" not in config
    assert "embed_tokens.weight" not in t and "lm_head.weight" not in t


def test_dspark_head_options(tiny_target):
    config, t = vllm_export(make(tiny_target, "dspark", enable_confidence_head=False), tiny_target, "speculators")
    assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"]) == (32, "vanilla", False)
    assert not any(k.startswith("confidence_head") for k in t) and "markov_head.markov_w1.weight" in t
    for kind in ("none", "rnn"):  # vLLM's DSpark has a linear Markov head only
        with pytest.raises(ExportError, match=f"linear Markov head only; markov_head='{kind}'"):
            vllm_export(make(tiny_target, "dspark", markov_head=kind), tiny_target, "speculators")


def test_dflash_sampling_from_anchor_refused(tiny_target):
    with pytest.raises(ExportError, match="mask slots only"):
        vllm_export(make(tiny_target, "dflash", sample_from_anchor=True), tiny_target, "speculators")


def test_medusa_native(tiny_target):
    d = make(tiny_target, "medusa", medusa_heads=3, medusa_layers=2)
    config, t = vllm_export(d, tiny_target, "native")
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (3, 2, 64, 512)
    assert config["medusa_fc_bias"] is True  # our residual blocks have biases; vLLM's default is none
    want = {f"blocks.{k}.layers.{j}.{w}" for k in range(3) for j in range(2) for w in ("weight", "bias")}
    assert set(t) == want | {f"lm_heads.{k}.weight" for k in range(3)}
    with pytest.raises(ExportError, match="only the native"):
        vllm_export(d, tiny_target, "speculators")


def test_unsupported_exports_named(tiny_target):
    with pytest.raises(ExportError, match="no vLLM layout for drafter 'mtp'.*dflash, dspark, eagle3, medusa, peagle"):
        vllm_export(make(tiny_target, "mtp"), tiny_target)
    with pytest.raises(ExportError, match="layout 'hf'"):
        vllm_export(make(tiny_target, "dflash"), tiny_target, "hf")
    with pytest.raises(ExportError, match="no SGLang layout for drafter 'dspark'"):
        sglang_export(make(tiny_target, "dspark"), tiny_target)


def test_eagle3_sglang(tiny_target, tmp_path):
    d = make(tiny_target, "eagle3", layer_ids=[0, 1, 2])
    path = export_sglang(d, tiny_target, tmp_path / "sg")
    config = json.loads((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds +1 itself
    assert "eagle_aux_hidden_state_layer_ids" not in config
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.hidden_norm.weight"} <= set(t)
    assert t["d2t"].dtype == torch.int64 and not t["d2t"].any() and t["t2d"].all()  # identity map
    with pytest.raises(ExportError, match="exactly 3"):
        sglang_export(make(tiny_target, "eagle3", layer_ids=[0, 2]), tiny_target)


def test_exported_weights_equal_drafter(tiny_target):
    d = make(tiny_target, "dspark")
    _, t = vllm_export(d, tiny_target, "speculators")
    for name, value in d.state_dict().items():
        assert torch.equal(t[name.removeprefix("backbone.")], value)


def _without_slot_heads(drafter):
    declared = drafter.capabilities() - {Capability.SLOT_HEADS}
    drafter.capabilities = lambda: declared
    return drafter


def test_slot_head_fields_follow_the_declared_capability(tiny_target):
    """The exporter writes DSpark's head fields because the drafter declares SLOT_HEADS, not
    because it has a ``markov_head`` attribute: without the declaration it is a head-less block
    drafter, exported and refused exactly as DFlash is."""
    assert Capability.SLOT_HEADS in make(tiny_target, "dspark").capabilities()
    assert Capability.SLOT_HEADS not in make(tiny_target, "dflash").capabilities()
    headless = _without_slot_heads(make(tiny_target, "dspark"))  # samples from the anchor by default
    with pytest.raises(ExportError, match="dspark: vLLM's DFlash drafts from the mask slots only.*slot_heads"):
        vllm_export(headless, tiny_target, "speculators")
    headless = _without_slot_heads(make(tiny_target, "dspark", sample_from_anchor=False))
    for layout in ("speculators", "native"):
        config, _ = vllm_export(headless, tiny_target, layout)
        assert not {"markov_rank", "markov_head_type", "enable_confidence_head"} & set(config), layout
        assert "markov_rank" not in config.get("dflash_config", {}), layout
