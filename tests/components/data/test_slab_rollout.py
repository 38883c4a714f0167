"""Rollouts on the fast step (``components.data.slab_rollout``) and the multi-sequence kernel pass
under them (``StaticDecoder.forward_rows``): the same records as the transformers path
(``rollout.generate`` + ``rollout.capture``) — tokens equal in float32 but for a named near-tie,
hidden states equal to float32 rounding — with fewer rows than prompts (rows handed on), with
sampling (same seeds, same draws), through the kernel and through the torch reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from components.config import DataConfig
from components.data.prompts import Prompt
from components.data.records import RecordMeta
from components.data.rollout import capture, generate
from components.data.slab_rollout import slab_rollouts
from components.target.fast import KernelGemm
from components.target.kernels import RowsGemm, why_unavailable
from components.target.step import StaticDecoder
from tests.components.target.test_step import _same_or_near_tie

TAPS = (0, 1)
TEXTS = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
         "The capital of France", "x = [1, 2, 3]\nfor i in x:\n", "Once upon a time"]


@pytest.fixture(scope="module")
def decoders(tiny_target, tmp_path_factory) -> dict[str, StaticDecoder]:
    """The torch reference always; the kernel where this CPU runs it."""
    out = {"torch": StaticDecoder(tiny_target.model, TAPS, 256)}
    if why_unavailable() is None:
        kernel = RowsGemm.build(tmp_path_factory.mktemp("kernels"))
        out["kernel"] = StaticDecoder(tiny_target.model, TAPS, 256, KernelGemm(kernel), kernel)
    return out


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[Prompt]:
    return [Prompt(f"p{i}", tuple(tiny_target.tokenizer(t)["input_ids"]), seed=100 + i) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def meta(tiny_target) -> RecordMeta:
    return RecordMeta(target="tiny", tokenizer_hash="-", layer_ids=TAPS, last_layer=tiny_target.num_layers - 1,
                      hidden_size=tiny_target.hidden_size, storage="float32")


def _stop_ids(target) -> list[int]:
    return [target.tokenizer.eos_token_id]


def _reference(target, prompts, cfg, meta):
    """The transformers path, one batch per prompt (no padding in the comparison)."""
    out = []
    for p in prompts:
        response = generate(target, [p], cfg, _stop_ids(target), target.tokenizer.eos_token_id)
        out += capture(target, [p], response, meta, target.tokenizer.eos_token_id)
    return out


@pytest.mark.parametrize("which", ["kernel", "torch"])
@pytest.mark.parametrize("rows", [2, 8])
def test_greedy_records_equal_the_transformers_paths(tiny_target, decoders, prompts, meta, which, rows):
    if which not in decoders:
        pytest.skip(f"kernel: {why_unavailable()}")
    cfg = DataConfig(max_new_tokens=20, temperature=0.0)
    finished: list[str] = []
    got = slab_rollouts(decoders[which], prompts, cfg, _stop_ids(tiny_target), meta, rows,
                        on_records=lambda rs: finished.extend(r.sample_id for r in rs))
    want = _reference(tiny_target, prompts, cfg, meta)
    assert sorted(finished) == sorted(p.prompt_id for p in prompts)  # each reported once
    assert [r.sample_id for r in got] == [p.prompt_id for p in prompts]  # in the prompts' order
    for g, w, p in zip(got, want, prompts):
        plen = len(p.input_ids)
        assert g.prompt_len == plen and g.loss_mask.sum() == g.num_tokens - plen
        if g.input_ids.tolist() != w.input_ids.tolist():
            _same_or_near_tie(tiny_target, list(p.input_ids), g.input_ids[plen:].tolist(), w.input_ids[plen:].tolist())
            continue
        assert g.hidden.shape == w.hidden.shape == (g.num_tokens, len(TAPS), tiny_target.hidden_size)
        np.testing.assert_allclose(g.hidden, w.hidden, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(g.last_hidden, w.last_hidden, atol=2e-4, rtol=1e-4)


def test_sampled_records_draw_what_the_transformers_path_draws(tiny_target, decoders, prompts, meta):
    """Same seed per prompt, one draw per token in order: the same responses (the logits agree to
    float32 rounding; a draw landing on a boundary between two tokens would be a 1e-6 event)."""
    decoder = decoders.get("kernel", decoders["torch"])
    cfg = DataConfig(max_new_tokens=16, temperature=0.9, top_p=0.95)
    got = slab_rollouts(decoder, prompts, cfg, _stop_ids(tiny_target), meta, rows=3)
    want = _reference(tiny_target, prompts, cfg, meta)
    assert [r.input_ids.tolist() for r in got] == [r.input_ids.tolist() for r in want]


def test_rows_of_a_multi_sequence_pass_equal_one_sequence_at_a_time(tiny_target, decoders):
    """forward_rows over three sequences at different positions (two rows of one of them) equals
    each sequence's batch-1 pass, and writes the same keys."""
    for which, decoder in decoders.items():
        gen = torch.Generator().manual_seed(0)
        lengths = [5, 9, 3]
        seqs = [torch.randint(0, tiny_target.vocab_size, (n + 2,), generator=gen) for n in lengths]
        k, v = decoder.new_slab(3, slots=32)
        k1, v1 = decoder.new_slab(1, slots=32)
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            decoder.forward_rows(s[:n], torch.full((n,), b), torch.arange(n), k, v)
        # one row for sequences 0 and 2, two rows (causal) for sequence 1
        ids = torch.stack([seqs[0][5], seqs[1][9], seqs[1][10], seqs[2][3]])
        seq, pos = torch.tensor([0, 1, 1, 2]), torch.tensor([5, 9, 10, 3])
        logits, taps, _ = decoder.forward_rows(ids, seq, pos, k, v)
        for r, (b, upto) in enumerate([(0, 6), (1, 10), (1, 11), (2, 4)]):
            alone, alone_taps, _ = decoder.forward_rows(seqs[b][:upto], torch.zeros(upto, dtype=torch.long),
                                                        torch.arange(upto), k1, v1)
            torch.testing.assert_close(logits[r], alone[-1], atol=1e-4, rtol=1e-4, msg=f"{which} row {r}")
            torch.testing.assert_close(taps[r], alone_taps[-1], atol=1e-4, rtol=1e-4)
            for layer in range(len(k)):
                torch.testing.assert_close(k[layer][b, :, :upto], k1[layer][0, :, :upto], atol=1e-4, rtol=1e-4)


def test_a_prompt_past_the_slab_is_a_clear_error(tiny_target, decoders, prompts, meta):
    cfg = DataConfig(max_new_tokens=300)
    with pytest.raises(ValueError, match="target.static_len"):
        slab_rollouts(decoders["torch"], prompts, cfg, _stop_ids(tiny_target), meta, rows=2)


def test_taps_must_be_the_records_layers(tiny_target, decoders, prompts, meta):
    with pytest.raises(ValueError, match="taps"):
        slab_rollouts(decoders["torch"], prompts, DataConfig(), _stop_ids(tiny_target),
                      dataclasses.replace(meta, layer_ids=(1,)), rows=2)


def test_the_roller_takes_the_fast_step_where_target_step_chooses_it(tiny_target_cfg, tiny_target, prompts, meta):
    """``Roller`` (one per Ray Data actor): step ``fast`` rolls out on the slab, ``hf`` on the
    transformers forward; same records but for float32 rounding."""
    from components.data.rollout import Roller

    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    cfg = DataConfig(max_new_tokens=12, batch_size=4)
    fast = Roller(dataclasses.replace(tiny_target_cfg, step="fast", static_len=256), cfg, meta)
    plain = Roller(dataclasses.replace(tiny_target_cfg, step="hf"), cfg, meta)
    assert fast.decoder is not None and plain.decoder is None and "target.step: hf" in plain.why_not_fast
    got, want = fast(prompts), plain(prompts)
    assert fast.seconds["capture"] == 0.0 < fast.seconds["generate"]
    for g, w, p in zip(got, want, prompts):
        assert g.sample_id == w.sample_id
        if g.input_ids.tolist() == w.input_ids.tolist():
            np.testing.assert_allclose(g.hidden, w.hidden, atol=2e-4, rtol=1e-4)
        else:
            plen = len(p.input_ids)
            _same_or_near_tie(tiny_target, list(p.input_ids), g.input_ids[plen:].tolist(), w.input_ids[plen:].tolist())
