"""Offline training components in-process (no Ray): batches, steps, NaN stop, checkpoint resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from components.config import DrafterConfig, TrainConfig
from components.data.records import Record, encode
from components.drafters import build_drafter
from components.drafters.base import DraftBatch
from components.training import (
    NonFiniteLossError,
    TrainState,
    collate,
    heldout_ids,
    load_checkpoint,
    new_train_state,
    save_checkpoint,
    train_step,
)

TC = TrainConfig(lr=3e-3, warmup_steps=1, grad_clip=1.0)
DRAFTER = DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8)


def _record(target, layer_ids, n_tokens: int, prompt: int, seed: int, storage: str) -> Record:
    """A record with the fixture target's real hidden states for random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, target.vocab_size, (1, n_tokens), generator=g)
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    hs = out.hidden_states
    hidden = torch.stack([hs[i + 1][0] for i in layer_ids], dim=1).numpy()  # [T, n, H]
    last = hs[-1][0].numpy()  # post-norm in HF; any float state works for these tests
    h, hsc = encode(hidden, storage)
    lh, lsc = encode(last, storage)
    mask = np.zeros(n_tokens, np.uint8)
    mask[prompt:] = 1
    return Record(f"r{seed}", ids[0].numpy().astype(np.int32), mask, h, lh, hsc, lsc, prompt, seed)


def first_step_descends(state: TrainState, batch: DraftBatch, seed: int, grad_clip: float = 1.0) -> dict[str, float]:
    """The first ``train_step`` of a fresh state, checked against an independent forward/backward
    with the generator at ``seed`` (same anchors): it reports the objective's loss at the old
    weights and moves them against that loss's gradient g, ⟨Δθ, g⟩ < 0.

    This holds for any weights and data, so for any fixture target: AdamW's first step without
    weight decay is Δθ_i = −lr·g_i / (|g_i| + ε), and gradient clipping rescales g without
    changing a sign. (A loss that must have fallen by some margin after n steps depends on the
    fixture target's hidden states, which come out differently on another CPU.)"""
    assert state.step == 0 and all(group["weight_decay"] == 0 for group in state.optimizer.param_groups)
    params = [p for p in state.drafter.parameters() if p.requires_grad]
    state.objective.train()
    state.generator.manual_seed(seed)
    loss, _ = state.objective(batch, state.generator)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    before = [p.detach().clone() for p in params]
    state.generator.manual_seed(seed)
    metrics = train_step(state, batch, grad_clip)
    assert metrics["train/loss"] == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-9)
    moved = sum(float(((p.detach() - b) * g).sum()) for p, b, g in zip(params, before, grads) if g is not None)
    assert moved < 0, moved
    return metrics


@pytest.fixture(scope="module")
def setup(tiny_target):
    torch.manual_seed(0)
    drafter = build_drafter(DRAFTER, tiny_target)
    records = [_record(tiny_target, drafter.layer_ids, n, 3, i, "int8" if i % 2 else "float16")
               for i, n in enumerate([20, 14, 17, 20])]
    return tiny_target, records


def _state(target, steps: int = 20):
    torch.manual_seed(0)
    return new_train_state(build_drafter(DRAFTER, target), TC, steps, seed=1)


def test_collate_pads_right_and_decodes(setup):
    _, records = setup
    b = collate(records[:2])
    assert b.input_ids.shape == (2, 20) and b.hidden.dtype == torch.float32
    assert b.hidden.shape[:3] == (2, 20, records[0].hidden.shape[1])
    assert b.loss_mask[1, 14:].sum() == 0 and b.loss_mask[1, :3].sum() == 0 and b.loss_mask[1, 3:14].all()
    assert (b.input_ids[1, 14:] == 0).all() and (b.hidden[1, 14:] == 0).all()
    np.testing.assert_allclose(b.hidden[1, :14].numpy(), records[1].hidden_f32(), rtol=0, atol=0)


def test_heldout_split_is_deterministic_and_partial():
    ids = [f"s{i}" for i in range(20)]
    held = heldout_ids(ids, 0.1, seed=0)
    assert len(held) == 2 and held == heldout_ids(list(reversed(ids)), 0.1, seed=0)
    assert heldout_ids(["a"], 0.5, 0) == set() and len(heldout_ids(ids[:2], 0.9, 0)) == 1


def test_a_step_descends_the_loss_it_reports_and_steps_stay_finite(setup):
    target, records = setup
    state, batch = _state(target), collate(records)
    losses = [first_step_descends(state, batch, seed=5, grad_clip=TC.grad_clip)["train/loss"]]
    for _ in range(11):
        losses.append(train_step(state, batch, TC.grad_clip)["train/loss"])
    assert state.step == 12 and np.isfinite(losses).all(), losses


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def test_nan_loss_stops_before_touching_weights_or_checkpoint(setup, tmp_path):
    target, records = setup
    state, batch = _state(target), collate(records)
    train_step(state, batch)
    ckpt = save_checkpoint(state, tmp_path / "ckpt")
    before, digest = {k: v.clone() for k, v in state.drafter.state_dict().items()}, _digest(ckpt)
    bad = collate(records)
    bad.hidden[0, 4] = float("nan")
    with pytest.raises(NonFiniteLossError, match="step 2: non-finite"):
        train_step(state, bad)
    assert state.step == 1 and _digest(ckpt) == digest
    assert all(torch.equal(before[k], v) for k, v in state.drafter.state_dict().items())


def test_checkpoint_resume_matches_an_uninterrupted_run(setup, tmp_path):
    target, records = setup
    batch = collate(records)
    straight = _state(target)
    for _ in range(2):
        train_step(straight, batch)
    first = _state(target)
    for _ in range(2):
        train_step(first, batch)
    first.epoch, first.batch_in_epoch = 1, 2
    save_checkpoint(first, tmp_path / "ckpt")
    resumed = _state(target)
    torch.manual_seed(123)  # the global RNG is restored from the checkpoint, whatever it was
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (2, 1, 2)
    assert resumed.scheduler.last_epoch == 2 and straight_lr(resumed) == straight_lr(straight)
    assert torch.equal(resumed.generator.get_state(), first.generator.get_state())
    opt_a, opt_b = first.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)
    m_straight, m_resumed = train_step(straight, batch), train_step(resumed, batch)
    assert m_resumed["train/loss"] == m_straight["train/loss"]
    assert all(torch.equal(a, b) for a, b in zip(straight.drafter.parameters(), resumed.drafter.parameters()))


def straight_lr(state) -> float:
    return state.optimizer.param_groups[0]["lr"]


def test_bf16_autocast_step_keeps_fp32_weights_and_names_bad_settings(setup):
    target, records = setup
    torch.manual_seed(0)
    tc = TrainConfig(lr=3e-3, warmup_steps=1, mixed_precision="bf16")
    state = new_train_state(build_drafter(DRAFTER, target), tc, 5, seed=1)
    metrics = train_step(state, collate(records))
    assert np.isfinite(metrics["train/loss"]) and state.step == 1
    assert all(p.dtype == torch.float32 for p in state.drafter.parameters())
    with pytest.raises(ValueError, match="train.mixed_precision: 'fp8'"):
        new_train_state(build_drafter(DRAFTER, target), TrainConfig(mixed_precision="fp8"), 5, seed=1)


@pytest.mark.parametrize("vendor,flags,faster", [("AuthenticAMD", "avx512_bf16", True),
                                                  ("GenuineIntel", "avx512_bf16 amx_bf16 amx_tile", True),
                                                  ("GenuineIntel", "avx512_bf16", False)])
def test_auto_mixed_precision_follows_what_the_device_declares(monkeypatch, vendor, flags, faster):
    """``auto``: bf16 where oneDNN (CPU) or CUDA says bf16 products are native, except on an Intel
    CPU without AMX tiles (where they measured slower than float32's)."""
    from components.training import step

    declared = {"vendor_id": vendor, "flags": flags}
    monkeypatch.setattr(step, "cpuinfo", declared.get)
    assert step.autocast_dtype("no") is None and step.autocast_dtype("bf16") is torch.bfloat16
    for native in (True, False):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda native=native: native)
        assert step.autocast_dtype("auto", "cpu") is (torch.bfloat16 if native and faster else None)
