"""The fast target step (``components.target.step``, ``fast``, ``kernels``): its kernel against
torch's product, its decoder against the transformers forward, and greedy decoding through it
token for token against the transformers target (float32), in the plain baseline and the chain
engine with every registered drafter and the model-free ones."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import components.drafters  # noqa: F401  (registers every family)
from components.drafters.registry import DRAFTERS
from components.engine import (
    PromptLookupDrafter,
    SpeculativeEngine,
    SuffixDrafter,
    target_only_generate,
)
from components.engine.core import crop_cache
from components.evaluation.runner import NEAR_TIE
from components.target.fast import MAX_KERNEL_ROWS, KernelGemm, StepTarget, step_target, step_wanted
from components.target.hf import Target, TargetError
from components.target.kernels import ATTEND_CHUNK, RowsGemm, isas, why_unavailable
from components.target.step import StaticCache, causal_mask
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter

needs_kernel = pytest.mark.skipif(why_unavailable() is not None, reason=f"kernel: {why_unavailable()}")


@pytest.fixture(scope="module", params=[isa for isa in isas() if isa != "amx"] or ["none"])
def kernel(request, tmp_path_factory) -> RowsGemm:
    """The kernel built for each instruction set this CPU runs (AVX-512 CPUs: both builds; the AMX
    build's float32 panels are AVX-512's, its Q4_1 products are test_blocks.py's)."""
    return RowsGemm.build(tmp_path_factory.mktemp("kernels"), request.param)


@pytest.fixture(scope="module")
def references(tiny_target) -> list[list[int]]:
    """The transformers target's greedy continuations of the engine tests' prompts."""
    return [target_only_generate(tiny_target, p, MAX_NEW).tokens for p in prompts(tiny_target)]


@pytest.fixture(scope="module")
def fast(tiny_target_cfg, tiny_target) -> StepTarget:
    """The fixture target behind the fast step (kernel where this CPU runs it), taps 0 and 1."""
    cfg = dataclasses.replace(tiny_target_cfg, step="fast" if why_unavailable() is None else "auto", static_len=256)
    made = step_target(tiny_target, cfg, taps=(0, 1)) if cfg.step == "fast" else StepTarget(tiny_target, (0, 1), 256)
    assert isinstance(made, StepTarget)
    return made


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("k", [8, 37, 64, 100])  # 100: a float32 panel past a multiple of 32 k
def test_kernel_equals_torch(kernel, rows, k):
    """Unpacked and packed weights; 45 and 77 weight rows: not multiples of the 16-row panel."""
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen)
    for n in (45, 77):
        w = torch.randn(n, k, generator=gen)
        packed = kernel.pack(w)
        assert packed.panels.shape == ((n + 15) // 16, k, 16) and packed.shape == w.shape
        for threads in (1, 2):
            torch.testing.assert_close(kernel.linear(x, w, threads), x @ w.T, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kernel.linear(x, packed, threads), x @ w.T, rtol=1e-5, atol=1e-5)
        assert kernel.linear(x.view(1, rows, k), w).shape == (1, rows, n)
        assert kernel.linear(x.view(1, rows, k), packed).shape == (1, rows, n)


@needs_kernel
def test_kernel_gemm_packs_once_and_leaves_many_rows_to_torch(kernel):
    gemm, w = KernelGemm(kernel), torch.randn(40, 24)
    packed = gemm.prepare(w)
    assert packed.weight is w
    for rows in (3, MAX_KERNEL_ROWS + 1):
        x = torch.randn(1, rows, 24)
        torch.testing.assert_close(gemm(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)


def test_decoder_equals_transformers_over_a_prefill_and_steps(tiny_target, fast):
    """Prefill, then passes of 1..5 new tokens, each cropped back: logits, taps and last hidden
    state as transformers computes them (float32)."""
    ids = torch.tensor([prompts(tiny_target)[0] * 3], dtype=torch.long)[:, :40]
    ref = tiny_target.forward(ids[:, :30], layer_ids=[1, 0], use_cache=True)
    out = fast.forward(ids[:, :30], layer_ids=[1, 0], use_cache=True)
    assert isinstance(out.cache, StaticCache) and out.cache.get_seq_length() == 30
    for got, want in ((out.logits, ref.logits), (out.hidden, ref.hidden), (out.last_hidden, ref.last_hidden)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for count in range(1, 6):
        r = tiny_target.forward(ids[:, 30:30 + count], layer_ids=[0], cache=ref.cache, use_cache=True)
        o = fast.forward(ids[:, 30:30 + count], layer_ids=[0], cache=out.cache, use_cache=True)
        torch.testing.assert_close(o.logits, r.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(o.hidden, r.hidden, rtol=1e-4, atol=1e-4)
        crop_cache(ref.cache, 30), crop_cache(out.cache, 30)
        assert out.cache.get_seq_length() == 30


def test_passes_it_does_not_serve_go_to_transformers(tiny_target, fast):
    ids = torch.tensor([prompts(tiny_target)[1][:6]] * 2, dtype=torch.long)
    out = fast.forward(ids, use_cache=True)  # a batch of two: an HF cache
    assert not isinstance(out.cache, StaticCache)
    torch.testing.assert_close(out.logits, tiny_target.forward(ids).logits)
    assert not isinstance(fast.forward(ids[:1], layer_ids=[2], use_cache=True).cache, StaticCache)  # taps outside


def test_a_sequence_past_the_static_cache_is_a_clear_error(tiny_target, fast):
    ids = torch.zeros(1, fast.capacity + 1, dtype=torch.long)
    with pytest.raises(TargetError, match="target.static_len"):
        fast.forward(ids, use_cache=True)


def test_causal_mask_reads_the_slots_up_to_each_token():
    assert causal_mask(5, 1, torch.device("cpu")) is None
    mask = causal_mask(2, 3, torch.device("cpu"))[0, 0]  # [3, 5]
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


def _same_or_near_tie(target, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Token for token; a flip is allowed only where the eval's near-tie rule names it (said)."""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = target.forward(torch.tensor([prompt + want[:at]])).logits[0, -1]
    margin = float(logits[want[at]] - logits[got[at]])
    assert abs(margin) < NEAR_TIE, f"not lossless at token {at}: margin {margin} is no near-tie"
    print(f"near-tie flip at token {at} (margin {margin:.2e}); the rest is not compared")


def test_plain_decoding_through_it_is_the_targets(tiny_target, fast, references):
    for prompt, ref in zip(prompts(tiny_target), references):
        _same_or_near_tie(tiny_target, prompt, target_only_generate(fast, prompt, MAX_NEW).tokens, ref)


@pytest.mark.parametrize("name", sorted(DRAFTERS) + ["prompt_lookup", "suffix"])
def test_chain_engine_through_it_is_lossless(tiny_target, fast, references, name):
    if name == "prompt_lookup":
        drafter = PromptLookupDrafter(tiny_target.vocab_size, 4)
    elif name == "suffix":
        drafter = SuffixDrafter(tiny_target.vocab_size, 8)
    else:
        drafter = random_drafter(tiny_target, name)
    taps = tuple(drafter.layer_ids)
    target = fast if set(taps) <= set(fast.taps) else StepTarget(tiny_target, taps, 256, fast.decoder.gemm)
    gamma = 3 if name == "peagle" else 4  # P-EAGLE drafts at most the depths it trained (3 by default)
    engine = SpeculativeEngine(target, drafter, rule="greedy", num_speculative_tokens=gamma)
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        _same_or_near_tie(tiny_target, prompt, out.tokens, ref)
        assert out.target_forwards == out.rounds + 1


def test_step_setting(tiny_target_cfg, tiny_target):
    auto = step_wanted(tiny_target_cfg, tiny_target)
    assert auto[0] is False and "tiny test fixture" in auto[1]
    assert step_target(tiny_target, dataclasses.replace(tiny_target_cfg, step="hf")) is tiny_target
    with pytest.raises(TargetError, match="target.step: 'fastest'"):
        step_wanted(dataclasses.replace(tiny_target_cfg, step="fastest"), tiny_target)
    # a copy: casting the shared fixture to bf16 and back would round its weights for every later test
    model = copy.deepcopy(tiny_target.model).to(torch.bfloat16)
    bf16 = type(tiny_target)(model, tiny_target.tokenizer, tiny_target.name_or_path)
    with pytest.raises(TargetError, match="runs float32"):
        step_wanted(dataclasses.replace(tiny_target_cfg, step="fast"), bf16)


def test_streamed_linears_keep_the_transformers_forward(tiny_target_cfg, tmp_path):
    from components.target import load_target
    from components.target.fast import StreamingLinear, stream_linears

    target = load_target(tiny_target_cfg, progress=False)
    ids = torch.tensor([prompts(target)[0] * 12], dtype=torch.long)[:, :40]  # 40 rows: past the kernel's 32
    before = target.forward(ids).logits
    assert stream_linears(target, tiny_target_cfg) == 0  # auto: not on the test fixture
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", cache_dir=str(tmp_path))
    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    changed = stream_linears(target, cfg)
    assert changed == sum(isinstance(m, StreamingLinear) for m in target.model.modules()) > 0
    torch.testing.assert_close(target.forward(ids[:, :8]).logits, before[:, :8], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target.forward(ids).logits, before, rtol=1e-4, atol=1e-4)  # more rows: torch's


def test_a_drafters_linears_stream_and_the_targets_stay(tiny_target_cfg, tiny_target, tmp_path):
    from components.target.fast import StreamingLinear, stream_linears

    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    drafter = random_drafter(tiny_target, "dspark")
    drafter.shared_head = tiny_target.lm_head  # a drafter holding one of the target's own layers
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", cache_dir=str(tmp_path))
    assert stream_linears(tiny_target, cfg, modules=[drafter], keep_target=True) > 0
    assert not any(isinstance(m, StreamingLinear) for m in tiny_target.model.modules())
    streamed = [m for m in drafter.modules() if isinstance(m, StreamingLinear)]
    assert streamed and {m.packed.format for m in streamed} == {"q8_0"}  # draft_weights auto: quantized
    assert drafter.identity().endswith(":q8_0:fused")  # round profiles measured with float32 products are not reused
    engine = SpeculativeEngine(tiny_target, drafter, rule="greedy")
    prompt = prompts(tiny_target)[0]
    assert engine.generate(prompt, MAX_NEW).tokens == target_only_generate(tiny_target, prompt, MAX_NEW).tokens


def test_a_drafters_linears_stream_as_float32_when_asked(tiny_target_cfg, tiny_target, tmp_path):
    from components.target.fast import StreamingLinear, stream_linears

    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    drafter = random_drafter(tiny_target, "dspark")
    x = torch.randn(3, drafter.backbone.fc.in_features)
    with torch.no_grad():
        before = drafter.backbone.fc(x)
        cfg = dataclasses.replace(tiny_target_cfg, step="fast", cache_dir=str(tmp_path), draft_weights="float32")
        assert stream_linears(tiny_target, cfg, modules=[drafter], keep_target=True) > 0
        assert {m.packed.format for m in drafter.modules() if isinstance(m, StreamingLinear)} == {"f32"}
        torch.testing.assert_close(drafter.backbone.fc(x), before, rtol=1e-4, atol=1e-5)
    with pytest.raises(TargetError, match="draft_weights"):
        stream_linears(tiny_target, dataclasses.replace(cfg, draft_weights="int4"), modules=[drafter], keep_target=True)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (3, 3)])  # 3, 4 (3 + 1) and 1 query heads per kv head
@pytest.mark.parametrize("context", [41, 300])  # 300: past ATTEND_CHUNK keys, read in chunks and merged
def test_attention_of_every_group_size_equals_transformers(tiny_target, kernel, heads, kv_heads, context):
    """A random Llama with SmolLM2's group of 3 query heads per kv head (and 4, and none shared):
    a prefill, then passes of 1..9 new tokens over it, logits as transformers computes them (past
    ``ATTEND_CHUNK`` keys, from chunks merged)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(heads * 10 + kv_heads)
    config = LlamaConfig(vocab_size=96, hidden_size=64 * heads // 2, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                         max_position_embeddings=320, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    target = Target(model, tiny_target.tokenizer, f"random-llama-{heads}-{kv_heads}")
    fast = StepTarget(target, (), 320, KernelGemm(kernel), kernel)
    ids = torch.randint(0, 96, (1, context + 19))
    ref = target.forward(ids[:, :context], use_cache=True)
    out = fast.forward(ids[:, :context], use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for count in (1, 2, 5, 9):
        r = target.forward(ids[:, context:context + count], cache=ref.cache, use_cache=True)
        o = fast.forward(ids[:, context:context + count], cache=out.cache, use_cache=True)
        torch.testing.assert_close(o.logits, r.logits, rtol=1e-4, atol=1e-4)
        crop_cache(ref.cache, context), crop_cache(out.cache, context)
    model.double().float()  # the parameters' storage moves (the norms the kernel reads are the model's own)
    again = fast.forward(ids[:, context:context + 1], cache=out.cache, use_cache=True)
    want = target.forward(ids[:, context:context + 1], cache=ref.cache, use_cache=True).logits
    torch.testing.assert_close(again.logits, want, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 2), (8, 2)])  # 3, 2 and 4 query heads per kv head
@pytest.mark.parametrize("keys", [37, 290])  # 290: two chunks of keys, merged
def test_attention_by_kv_head_gives_the_bits_of_one_head_at_a_time(tiny_target, kernel, heads, kv_heads, keys):
    """A pass with enough units attends per (kv head, chunk of keys, row), reading the kv head's
    keys and values once for all its query heads; a one-row pass on more threads than that gives
    units attends per (head, chunk, row). Both do each query's arithmetic in the one-head order,
    with the same chunks (290 keys: two, merged), so the logits are the same bits either way (the
    GEMMs' bits do not depend on the thread count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(heads)
    config = LlamaConfig(vocab_size=96, hidden_size=64 * heads // 2, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                         max_position_embeddings=320, tie_word_embeddings=False)
    target = Target(LlamaForCausalLM(config).float().eval(), tiny_target.tokenizer, f"random-llama-{heads}-{kv_heads}")
    fast = StepTarget(target, (), 320, KernelGemm(kernel), kernel)
    cache = fast.new_cache()
    fast.forward(torch.randint(0, 96, (1, keys)), cache=cache, use_cache=True)  # 37: 4 blocks of 8 keys and a tail
    row = (torch.tensor([5]), torch.tensor([0]), torch.tensor([keys]))
    chunks = keys // ATTEND_CHUNK + 1
    by_kv_head = fast.decoder.forward_rows(*row, cache.k, cache.v, threads=1)[0]  # 2 kv heads x chunks >= 2 x 1
    by_head = fast.decoder.forward_rows(*row, cache.k, cache.v, threads=2 * chunks)[0]  # 2 x chunks < 2 x threads
    assert torch.equal(by_kv_head, by_head)


@needs_kernel
def test_all_layers_in_one_call_give_the_bits_of_a_call_per_layer(tiny_target, fast):
    """``forward_rows`` runs every layer in one kernel call (``RowsGemm.layers``); the taps it
    copies out and the state after the last layer are those of one ``RowsGemm.layer`` call per
    layer, bit for bit, for a one-row step and a multi-row pass of two sequences."""
    decoder, kernel = fast.decoder, fast.decoder.kernels
    pool = fast.slot_pool(2)
    for row, prompt in enumerate(prompts(tiny_target)[:2]):
        decoder.prefill_row(torch.tensor([prompt[:30]]), pool.k, pool.v, row)
    passes = [(torch.tensor([7]), torch.tensor([0]), torch.tensor([30])),  # one row
              (torch.tensor([3, 9, 4]), torch.tensor([0, 0, 1]), torch.tensor([30, 31, 30]))]  # two sequences
    for ids, seq, pos in passes:
        x = decoder.embed(ids).contiguous()
        taps = kernel.layers(x, seq, pos, decoder.shape, decoder.layers, pool.k, pool.v, decoder.cos, decoder.sin,
                             2, decoder.taps)
        y, want = decoder.embed(ids).contiguous(), []
        for i, layer in enumerate(decoder.layers):
            kernel.layer(y, seq, pos, decoder.shape, layer, pool.k[i], pool.v[i], decoder.cos, decoder.sin, 2)
            if i in decoder.taps:
                want.append(y.clone())
        assert taps.shape == (ids.shape[0], len(decoder.taps), decoder.shape.hidden)
        assert torch.equal(taps, torch.stack(want, dim=1)) and torch.equal(x, y)
        assert not torch.equal(taps[:, 0], taps[:, 1])  # the taps of different layers, not one copied twice



@needs_kernel
def test_the_layers_call_embeds_and_normalises_in_the_same_call(tiny_target, fast):
    """``RowsGemm.layers`` with the embedding table and the final norm: the same states as torch's
    embedding then the layers (bit for bit: a row copy), the last R rows normalised as torch's
    RMS norm does them (within float32 rounding); an id outside the table is an ``IndexError``
    raised before the slab is written."""
    decoder, kernel = fast.decoder, fast.decoder.kernels
    s, table = decoder.shape, decoder.embed.weight
    pool = fast.slot_pool(1)
    decoder.prefill_row(torch.tensor([prompts(tiny_target)[0][:20]]), pool.k, pool.v, 0)
    ids, seq, pos = torch.tensor([5, 11, 2]), torch.zeros(3, dtype=torch.long), torch.tensor([20, 21, 22])
    want = decoder.embed(ids).contiguous()
    want_taps = kernel.layers(want, seq, pos, s, decoder.layers, pool.k, pool.v, decoder.cos, decoder.sin, 2, decoder.taps)
    x, normed = torch.full((3, s.hidden), float("nan")), torch.empty(2, s.hidden)
    taps = kernel.layers(x, seq, pos, s, decoder.layers, pool.k, pool.v, decoder.cos, decoder.sin, 2, decoder.taps,
                         ids=ids, table=table, norm=decoder.final_norm, normed=normed)
    assert torch.equal(x, want) and torch.equal(taps, want_taps)
    ref = torch.nn.functional.rms_norm(want[1:], (s.hidden,), decoder.final_norm, s.eps)
    assert torch.allclose(normed, ref, rtol=1e-5, atol=1e-6) and not torch.equal(normed, want[1:])
    before = [t.clone() for t in pool.k]
    with pytest.raises(IndexError, match="outside the embedding table"):
        kernel.layers(x, seq, pos + 3, s, decoder.layers, pool.k, pool.v, decoder.cos, decoder.sin, 2, decoder.taps,
                      ids=torch.tensor([5, table.shape[0], 2]), table=table)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k))

def test_last_logits_are_the_last_row_of_the_full_pass(tiny_target, fast):
    """A prefill asks for its last position's logits only (both targets), and they are the full
    pass's last row."""
    ids = torch.tensor([prompts(tiny_target)[0]], dtype=torch.long)[:, :20]
    for target in (tiny_target, fast):
        full, last = target.forward(ids, use_cache=True), target.forward(ids, use_cache=True, last_logits=True)
        assert last.logits.shape == (1, 1, full.logits.shape[-1])
        torch.testing.assert_close(last.logits, full.logits[:, -1:], rtol=1e-5, atol=1e-5)
        assert last.cache.get_seq_length() == ids.shape[1]


@needs_kernel
def test_fma_rate_is_a_rate_of_the_builds_width(kernel):
    """The benchmark's arithmetic ceiling: GFLOP/s of the build's vector FMAs on one thread, a
    figure a CPU core can have (not a count of calls or of seconds)."""
    rate = kernel.fma_rate(1, seconds=0.02)
    assert 1 < rate < 10_000  # GFLOP/s of one core


@needs_kernel
def test_a_prompt_pass_on_more_threads_gives_the_same_bits(tiny_target, fast):
    """``prefill_threads``: the kernels split a pass's outputs between threads, each computed
    by one thread in one order, so a prompt prefilled on 3 threads leaves the logits, taps and
    keys/values of 1 thread, bit for bit (the batch engine's decode then cannot tell them apart)."""
    ids = torch.tensor([prompts(tiny_target)[0]], dtype=torch.long)[:, :40]
    got = []
    for threads in (1, 3):
        fast.prefill_threads = threads
        pool = fast.slot_pool(1)
        out = fast.prefill_slot(pool, ids, (0, 1))
        n = ids.shape[1]  # the slots the prompt wrote (the slab's others are uninitialised)
        got.append((out.logits, out.hidden, [k[..., :n, :].clone() for k in pool.k], [v[..., :n, :].clone() for v in pool.v]))
    fast.prefill_threads = 0
    (l1, h1, k1, v1), (l3, h3, k3, v3) = got
    assert torch.equal(l1, l3) and torch.equal(h1, h3)
    assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k3 + v3))
    with pytest.raises(ValueError, match="prefill_threads must be >= 0"):
        fast.prefill_threads = -1
