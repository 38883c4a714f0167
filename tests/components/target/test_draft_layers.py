"""A block drafter's decoder layers through the fast step's layer kernel
(``components.target.draft_layers``): the same block states as its torch layers, the calls it
declines, which drafters declare it, and decoding through it lossless."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.drafters.capabilities import Capability, has
from components.engine import SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.target.draft_layers import KernelLayers
from components.target.fast import stream_linears
from components.target.kernels import why_unavailable
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts

pytestmark = pytest.mark.skipif(why_unavailable() is not None, reason=f"kernel: {why_unavailable()}")


def random_drafter(target, name: str, num_layers: int = 2):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(name=name, num_layers=num_layers), target).eval()


def fused(tiny_target, tiny_target_cfg, tmp_path, name: str = "dspark", weights: str = "float32", layers: int = 2):
    """A random drafter whose linears stream through the kernel and whose block layers are fused."""
    drafter = random_drafter(tiny_target, name, num_layers=layers)
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", cache_dir=str(tmp_path), draft_weights=weights)
    stream_linears(tiny_target, cfg, modules=[drafter], keep_target=True)
    return drafter


def context_state(drafter, target, length: int):
    """The drafter's state after consuming ``length`` positions of random target taps."""
    state = drafter.init_state(1)
    taps = torch.randn(1, length, len(drafter.layer_ids), target.hidden_size)
    tokens = torch.randint(0, 50, (1, length))
    return drafter.consume(state, tokens, taps)


@pytest.mark.parametrize("length", [1, 13, 40])
def test_a_block_through_the_kernel_equals_torchs_layers(tiny_target, tiny_target_cfg, tmp_path, length):
    drafter = fused(tiny_target, tiny_target_cfg, tmp_path)
    run = drafter.backbone.layer_kernel
    assert isinstance(run, KernelLayers) and has(drafter, Capability.LAYER_KERNEL)
    state = context_state(drafter, tiny_target, length)
    ids = drafter.mask_block(torch.tensor([7]))
    with torch.no_grad():
        z_kernel = drafter.block_runner(state, 1)(ids)
        drafter.use_layer_kernel(None)
        z_torch = drafter.block_runner(state, 1)(ids)
    assert z_kernel.shape == z_torch.shape == (1, drafter.cfg.block_size, tiny_target.hidden_size)
    torch.testing.assert_close(z_kernel, z_torch, rtol=1e-4, atol=1e-4)


def test_the_kernel_declines_what_it_does_not_run(tiny_target, tiny_target_cfg, tmp_path):
    drafter = fused(tiny_target, tiny_target_cfg, tmp_path)
    run = drafter.backbone.layer_kernel
    state = context_state(drafter, tiny_target, 9)
    x = torch.randn(drafter.cfg.block_size, tiny_target.hidden_size)
    with torch.no_grad():
        assert run(x, 9, state.kv) is not None
        assert run(x, 8, state.kv) is None  # the rows must start right after the context
        assert run(x.double(), 9, state.kv) is None
        assert run(x, 3, []) is None  # no context, but not at position 0
        assert run(x, 0, []) is not None
    assert run(x, 9, state.kv) is None  # a differentiable call (training) keeps torch's layers


def test_rope_tables_grow_past_their_start(tiny_target, tiny_target_cfg, tmp_path, monkeypatch):
    from components.target import draft_layers

    monkeypatch.setattr(draft_layers, "ROPE_SLOTS", 8)
    drafter = fused(tiny_target, tiny_target_cfg, tmp_path)
    state = context_state(drafter, tiny_target, 20)
    ids = drafter.mask_block(torch.tensor([3]))
    with torch.no_grad():
        z_kernel = drafter.block_runner(state, 1)(ids)
        assert drafter.backbone.layer_kernel.cos.shape[0] >= 20 + drafter.cfg.block_size
        drafter.use_layer_kernel(None)
        torch.testing.assert_close(z_kernel, drafter.block_runner(state, 1)(ids), rtol=1e-4, atol=1e-4)


def test_only_plain_layers_are_fused(tiny_target, tiny_target_cfg, tmp_path):
    assert has(random_drafter(tiny_target, "dflash"), Capability.LAYER_KERNEL)
    dflash2 = fused(tiny_target, tiny_target_cfg, tmp_path, "dflash2")  # dynamic convolutions in its layers
    assert not has(dflash2, Capability.LAYER_KERNEL) and dflash2.backbone.layer_kernel is None
    eagle = fused(tiny_target, tiny_target_cfg, tmp_path, "eagle3", layers=1)
    assert not has(eagle, Capability.LAYER_KERNEL)


@pytest.mark.parametrize("weights", ["float32", "auto"])
def test_decoding_through_fused_layers_is_lossless(tiny_target, tiny_target_cfg, tmp_path, weights):
    drafter = fused(tiny_target, tiny_target_cfg, tmp_path, weights=weights)
    chain = SpeculativeEngine(tiny_target, drafter, rule="greedy", loop_stages=2)
    batch = BatchEngine(tiny_target, drafter, max_batch_size=3)
    ps = prompts(tiny_target)
    refs = [target_only_generate(tiny_target, p, MAX_NEW).tokens for p in ps]
    assert [chain.generate(p, MAX_NEW).tokens for p in ps] == refs
    results = batch.generate([Request(p, MAX_NEW, request_id=str(i)) for i, p in enumerate(ps)])
    assert [r.tokens for r in results] == refs
