"""Drafter checkpoints: HF-style directory, safetensors only, identical logits, loud mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.drafters import LAYER_ID_CONVENTION, DrafterError, load_drafter, save_drafter

NAMES = ["dspark", "dflash", "dflash2", "domino", "d_loop", "dedit", "hspec", "eagle3", "peagle", "medusa", "mtp"]


def logits_of(d, dr, target, ids):
    out = d.training_forward(dr.run(target, d, ids).batch(anchors=torch.tensor([[3, 9], [5, 11]])))
    return out.draft_logits, out.confidence_logits


@pytest.mark.parametrize("name", NAMES)
def test_save_load_identical_logits(tiny_target, ids, dr, tmp_path, name):
    d = dr.make(tiny_target, name)
    with torch.no_grad():  # move away from the init so a silently re-initialised weight shows
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_drafter(d, tmp_path / name)
    assert sorted(f.name for f in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(path, tiny_target)
    assert type(loaded) is type(d) and loaded.spec == d.spec
    for a, b in zip(logits_of(d, dr, tiny_target, ids), logits_of(loaded, dr, tiny_target, ids)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_config_json_fields(tiny_target, dr, tmp_path):
    d = dr.make(tiny_target, "dspark", block_size=5)
    raw = json.loads((save_drafter(d, tmp_path / "d") / "config.json").read_text())
    assert raw["architectures"] == ["DSparkDrafter"] and raw["name"] == "dspark"
    assert raw["layer_ids"] == d.layer_ids == [0, 1, 2]
    assert raw["layer_id_convention"] == LAYER_ID_CONVENTION
    assert raw["mask_token_id"] == tiny_target.tokenizer.mask_token_id
    assert raw["target_model_id"] == tiny_target.name_or_path
    assert raw["target_tokenizer_hash"] == tiny_target.tokenizer_hash
    assert (raw["target_hidden_size"], raw["target_vocab_size"], raw["num_target_layers"]) == (64, 512, 4)
    assert (raw["num_layers"], raw["block_size"], raw["num_speculative_tokens"], raw["sample_from_anchor"]) == (2, 5, 5, True)
    assert (raw["num_heads"], raw["num_kv_heads"], raw["head_dim"], raw["intermediate_size"]) == (2, 1, 32, 128)
    assert raw["rope_theta"] > 0 and raw["rms_norm_eps"] > 0
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert tensors["markov_head.markov_w1.weight"].shape == (512, 32)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("target_hidden_size", 128, "hidden size: checkpoint 128, target 64"),
    ("target_vocab_size", 999, "vocabulary size: checkpoint 999, target 512"),
    ("target_tokenizer_hash", "0123abcd", "tokenizer hash: checkpoint '0123abcd'"),
    ("num_target_layers", 36, "layer count: checkpoint 36, target 4"),
])
def test_other_target_refused(tiny_target, dr, tmp_path, key, value, named):
    path = save_drafter(dr.make(tiny_target, "dflash"), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match="another target") as err:
        load_drafter(path, tiny_target)
    assert named in str(err.value)


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_unexpected_misshapen_weights_named(tiny_target, dr, tmp_path):
    path = save_drafter(dr.make(tiny_target, "dspark"), tmp_path / "d")
    _rewrite(path, lambda t: t.pop("backbone.fc.weight"))
    with pytest.raises(DrafterError, match=r"missing weights \['backbone.fc.weight'\]"):
        load_drafter(path, tiny_target)
    path = save_drafter(dr.make(tiny_target, "dspark"), tmp_path / "d")  # overwrite in place
    _rewrite(path, lambda t: t.update({"extra.weight": torch.zeros(2)}))
    with pytest.raises(DrafterError, match=r"unexpected weights \['extra.weight'\]"):
        load_drafter(path, tiny_target)
    path = save_drafter(dr.make(tiny_target, "dspark"), tmp_path / "d")
    _rewrite(path, lambda t: t.update({"backbone.norm.weight": torch.zeros(3)}))
    with pytest.raises(DrafterError, match=r"backbone.norm.weight: checkpoint \(3,\), drafter \(64,\)"):
        load_drafter(path, tiny_target)


def test_unknown_config_field_refused(tiny_target, dr, tmp_path):
    path = save_drafter(dr.make(tiny_target, "eagle3"), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    raw["mystery"] = 1
    del raw["ttt_steps"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=r"unknown fields \['mystery'\].*lacks fields \['ttt_steps'\]"):
        load_drafter(path, tiny_target)


def test_store_shared_copies_checked(tiny_target, dr, tmp_path):
    path = save_drafter(dr.make(tiny_target, "medusa", store_shared=True), tmp_path / "d")
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(load_file(str(path / "model.safetensors")))
    load_drafter(path, tiny_target)
    _rewrite(path, lambda t: t["lm_head.weight"].add_(1.0))
    with pytest.raises(DrafterError, match="stored lm_head.weight differs from the target's"):
        load_drafter(path, tiny_target)


def test_no_leftovers_after_save(tiny_target, dr, tmp_path):
    d = dr.make(tiny_target, "mtp")
    save_drafter(d, tmp_path / "d")
    save_drafter(d, tmp_path / "d")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_checkpoint_from_before_a_field_existed_loads_with_the_old_behaviour(tiny_target, dr, tmp_path):
    path = save_drafter(dr.make(tiny_target, "dspark"), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    del raw["carryover"]  # written before carryover training existed
    (path / "config.json").write_text(json.dumps(raw))
    loaded = load_drafter(path, tiny_target)
    assert loaded.cfg.carryover is False and not hasattr(loaded, "carry_embed")


def test_checkpoint_with_an_old_field_name_loads(tiny_target, dr, tmp_path):
    path = save_drafter(dr.make(tiny_target, "dspark", num_speculative_tokens=5), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    raw["num_drafts"] = raw.pop("num_speculative_tokens")  # written before the rename
    (path / "config.json").write_text(json.dumps(raw))
    assert load_drafter(path, tiny_target).num_speculative_tokens == 5


def test_checkpoints_from_before_an_added_field_load_with_its_old_behaviour(tiny_target, dr, tmp_path):
    """A config.json written before a field existed (``ADDED_FIELDS``) still loads."""
    from components.drafters.checkpoint import ADDED_FIELDS

    path = save_drafter(dr.make(tiny_target, "dspark"), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    for name in ADDED_FIELDS:
        raw.pop(name, None)
    (path / "config.json").write_text(json.dumps(raw))
    loaded = load_drafter(path, tiny_target)
    assert all(getattr(loaded.cfg, name) == value for name, value in ADDED_FIELDS.items())


# DrafterConfig's fields when checkpoints were first written; every field added since must be in
# ADDED_FIELDS (with the value that gives an older checkpoint its old behaviour), or every older
# checkpoint stops loading.
FIRST_FIELDS = {"block_size", "enable_confidence_head", "head_dim", "intermediate_size", "layer_ids", "markov_head",
                "markov_rank", "mask_token_id", "medusa_heads", "medusa_layers", "mtp_depth", "name", "num_anchors",
                "num_heads", "num_kv_heads", "num_layers", "num_speculative_tokens", "num_taps", "sample_from_anchor",
                "store_shared", "ttt_steps"}


def test_every_field_added_since_the_first_checkpoints_has_its_old_behaviour():
    import dataclasses

    from components.config import DrafterConfig
    from components.drafters.checkpoint import ADDED_FIELDS

    added = {f.name for f in dataclasses.fields(DrafterConfig)} - FIRST_FIELDS
    assert added <= set(ADDED_FIELDS), f"list {sorted(added - set(ADDED_FIELDS))} in checkpoint.ADDED_FIELDS"
