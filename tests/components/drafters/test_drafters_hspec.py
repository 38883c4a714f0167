"""H-Spec: the target's K/V read in place (the engine attaches them), training ≡ inference with
K/V recomputed from the taps, a state that does not grow with the context, rollback, batched
proposals, windows and masked slots, and its configuration errors."""

from __future__ import annotations

import pytest
import torch

from components.drafters import DrafterError, TargetKV
from components.drafters.capabilities import Capability, has
from components.drafters.hspec import TAIL
from components.spec.sampling import GREEDY, SamplingParams


def attached(target, drafter, ids: torch.Tensor, cut: int):
    """The drafter state after consuming ids[:, :cut] with the target's cache of them attached
    (as an engine attaches it: views of the cache's layers)."""
    out = target.forward(ids[:, :cut], layer_ids=drafter.layer_ids, use_cache=True)
    state = drafter.consume(drafter.init_state(ids.shape[0]), ids[:, :cut], out.hidden)
    layers = drafter.target_kv_layers
    kv = TargetKV(layers, [(out.cache.layers[i].keys, out.cache.layers[i].values) for i in layers])
    return drafter.with_target_kv(state, kv), out.cache


def state_bytes(state) -> int:
    tensors = [t for kv in state.kv for t in kv] + ([state.feats] if state.feats is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def test_declares_target_kv_and_not_the_dflash_backbone(tiny_target, dr):
    d = dr.make(tiny_target, "hspec")
    assert has(d, Capability.TARGET_KV) and d.target_kv_layers == [2, 3]  # one past the two deepest taps
    assert not has(d, Capability.BLOCK_INTERNALS) and not has(d, Capability.OWN_CONTEXT)
    assert dr.make(tiny_target, "hspec", num_layers=4).target_kv_layers == [1, 2, 3]


def test_project_kv_is_what_the_target_caches(tiny_target):
    ids = torch.randint(10, tiny_target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out = tiny_target.forward(ids, layer_ids=[0, 1, 2], use_cache=True)
    positions = torch.arange(9).expand(2, 9)
    for layer in (1, 2, 3):
        k, v = tiny_target.project_kv(layer, out.hidden[:, :, layer - 1], positions)
        torch.testing.assert_close(k, out.cache.layers[layer].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, out.cache.layers[layer].values, rtol=1e-5, atol=1e-5)


def test_training_matches_inference(tiny_target, ids, dr):
    d = dr.make(tiny_target, "hspec")
    a = 11
    state, _ = attached(tiny_target, d, ids, a)
    prop = d.propose(state, ids[:, a], GREEDY)
    seq = torch.cat([ids[:, :a + 1], prop.tokens], dim=1)
    out = d.training_forward(dr.run(tiny_target, d, seq).batch(anchors=torch.full((2, 1), a)))
    torch.testing.assert_close(out.draft_logits, prop.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.target_tokens, prop.tokens) and prop.tokens.shape[1] == d.num_speculative_tokens


def test_state_does_not_grow_with_the_context(tiny_target, dr):
    d = dr.make(tiny_target, "hspec")
    dflash = dr.make(tiny_target, "dflash")
    sizes, growing = [], []
    for length in (32, 128, 400):
        ids = torch.randint(10, tiny_target.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        hidden = tiny_target.forward(ids, layer_ids=d.layer_ids).hidden
        state, _ = attached(tiny_target, d, ids, length)
        sizes.append(state_bytes(state))
        growing.append(state_bytes(dflash.consume(dflash.init_state(1), ids, hidden)))
        assert d.propose(state, ids[:, -1], GREEDY).tokens.shape == (1, d.num_speculative_tokens)
    assert sizes[0] == sizes[1] == sizes[2] > 0
    assert growing[0] < growing[1] < growing[2]


def test_reads_the_cache_in_place(tiny_target, ids, dr):
    """The proposal reads the cache's tensors themselves: changing the cache changes it, no copy kept."""
    d = dr.make(tiny_target, "hspec")
    state, cache = attached(tiny_target, d, ids, 12)
    before = d.propose(state, ids[:, 12], GREEDY).logits
    cache.layers[d.target_kv_layers[0]].keys.mul_(3.0)
    assert not torch.allclose(d.propose(state, ids[:, 12], GREEDY).logits, before)


def test_rollback_reproduces_proposals(tiny_target, ids, dr):
    d = dr.make(tiny_target, "hspec")
    run = dr.run(tiny_target, d, ids)
    base = d.consume(d.init_state(2), ids[:, :12], run.hidden[:, :12])
    longer = d.consume(base, ids[:, 12:18], run.hidden[:, 12:18])
    _, cache = attached(tiny_target, d, ids, 12)
    kv = TargetKV(d.target_kv_layers, [(cache.layers[i].keys, cache.layers[i].values) for i in d.target_kv_layers])
    first = d.propose(d.with_target_kv(base, kv), ids[:, 12], GREEDY)
    again = d.propose(d.with_target_kv(d.rollback(longer, 12), kv), ids[:, 12], GREEDY)
    torch.testing.assert_close(first.logits, again.logits, rtol=0, atol=0)
    with pytest.raises(DrafterError, match="rollback"):
        d.rollback(base, 13)
    far = d.consume(base, torch.zeros(2, TAIL, dtype=torch.long), run.hidden[:, :1].expand(2, TAIL, -1, -1))
    with pytest.raises(DrafterError, match=f"keeps the last {TAIL}"):
        d.rollback(far, 12)


def test_masked_slots_and_the_window(tiny_target, ids, dr):
    """Slots marked not valid (a batch cache's holes) are not read; the window keeps the last
    kv_window committed slots, counted over valid slots only."""
    d = dr.make(tiny_target, "hspec", kv_window=5)
    state, cache = attached(tiny_target, d, ids, 12)
    want = d.propose(state, ids[:, 12], GREEDY).logits
    layers = d.target_kv_layers
    holes = [(torch.cat([torch.randn_like(k[:, :, :3]), k[:, :, :8], torch.randn_like(k[:, :, :2]), k[:, :, 8:]], 2),
              torch.cat([torch.randn_like(v[:, :, :3]), v[:, :, :8], torch.randn_like(v[:, :, :2]), v[:, :, 8:]], 2))
             for k, v in ((cache.layers[i].keys, cache.layers[i].values) for i in layers)]
    valid = torch.tensor([[False] * 3 + [True] * 8 + [False] * 2 + [True] * 4] * 2)
    got = d.propose(d.with_target_kv(state, TargetKV(layers, holes, valid)), ids[:, 12], GREEDY).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = dr.make(tiny_target, "hspec", kv_window=2048)
    wide.load_state_dict(d.state_dict())
    assert not torch.allclose(wide.propose(wide.with_target_kv(state, state.target_kv), ids[:, 12], GREEDY).logits, want)


def test_propose_many_equals_propose_per_row(tiny_target, dr):
    d = dr.make(tiny_target, "hspec")
    texts = ["def main(args):\n    ", "x = 1", "class Foo:\n    def __init__(self"]
    states, last = [], []
    for text in texts:
        p = torch.tensor([tiny_target.tokenizer(text)["input_ids"]])
        states.append(attached(tiny_target, d, p, p.shape[1] - 1)[0])
        last.append(int(p[0, -1]))
    gammas = [3, 1, 4]
    for got, state, tok, g in zip(d.propose_many(states, torch.tensor(last), GREEDY, gammas), states, last, gammas):
        want = d.propose(state, torch.tensor([tok]), GREEDY, num_speculative_tokens=g)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7)]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    for i, got in enumerate(d.propose_many(states, torch.tensor(last), samplings, gammas, generators=gens)):
        want = d.propose(states[i], torch.tensor([last[i]]), samplings[i], torch.Generator().manual_seed(i), gammas[i])
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.probs, want.probs, atol=1e-4, rtol=1e-4)


def test_errors_name_what_to_fix(tiny_target, ids, dr):
    d = dr.make(tiny_target, "hspec")
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :8], run.hidden[:, :8])
    with pytest.raises(DrafterError, match="with_target_kv"):
        d.propose(state, ids[:, 8], GREEDY)
    with pytest.raises(DrafterError, match=r"reads target layers \[2, 3\], was handed \[1\]"):
        d.with_target_kv(state, TargetKV([1], [(torch.zeros(2, 1, 8, 32), torch.zeros(2, 1, 8, 32))]))
    with pytest.raises(DrafterError, match=r"drafter.kv_layers \[1, 4\]: each must be one past a tap"):
        dr.make(tiny_target, "hspec", kv_layers=[1, 4])
    with pytest.raises(DrafterError, match="carryover=false and drafter.retrace=false"):
        dr.make(tiny_target, "hspec", carryover=True)


def test_parallel_scan_is_the_recurrence():
    """One parallel pass equals U_i = a_i U_{i-1} + k_i v_iᵀ, o_i = U_iᵀ q_i + D x_i, step by step."""
    import torch.nn.functional as F

    from components.drafters.hspec import SelectiveScan

    torch.manual_seed(0)
    scan = SelectiveScan(hidden=16, heads=2, head_dim=4, state=3, eps=1e-6).double()
    x, u0 = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 2, 3, 4, dtype=torch.float64)
    xs, z, k, q, dt = scan.in_proj(x).split([8, 8, 6, 6, 2], dim=-1)
    dt = F.softplus(dt + scan.dt_bias)
    a = torch.exp(-torch.exp(scan.A_log) * dt)  # [2, 5, h]
    xs, k, q = xs.view(2, 5, 2, 4), k.view(2, 5, 2, 3), q.view(2, 5, 2, 3)
    u, outs = u0, []
    for i in range(5):
        u = a[:, i, :, None, None] * u + k[:, i, :, :, None] * (xs[:, i] * dt[:, i, :, None])[:, :, None, :]
        outs.append(torch.einsum("bhnp,bhn->bhp", u, q[:, i]) + scan.D.view(1, 2, 1) * xs[:, i])
    want = scan.out_proj(scan.norm(torch.stack(outs, 1).reshape(2, 5, 8) * F.silu(z)))
    torch.testing.assert_close(scan(x, u0), want)


@pytest.mark.parametrize("fast", [False, True])
def test_engines_lossless(tiny_target, dr, fast):
    """Greedy: the batch-1 and batch engines (on HF's cache, or the fast step's slab) equal plain
    decoding token for token; sampled: the batch engine equals the batch-1 engine, row by row."""
    from components.engine import SpeculativeEngine, target_only_generate
    from components.engine.batch import BatchEngine, Request
    from components.target.fast import StepTarget

    d = dr.make(tiny_target, "hspec")
    target = StepTarget(tiny_target, d.layer_ids, 256) if fast else tiny_target  # the decoder's torch reference
    texts = ["def main(args):\n    ", "x = 1", "class Foo:\n    def __init__(self", "import os\nimport sys\n"]
    prompts = [tiny_target.tokenizer(t)["input_ids"] for t in texts]
    refs = [target_only_generate(tiny_target, p, 14).tokens for p in prompts]
    single = SpeculativeEngine(target, d, rule="greedy")
    assert [single.generate(p, 14).tokens for p in prompts] == refs
    assert [r.tokens for r in BatchEngine(target, d, max_batch_size=3).generate(Request(p, 14) for p in prompts)] == refs
    sampling = SamplingParams(temperature=0.9)
    reqs = [Request(p, 14, sampling=sampling, seed=5 + i, rule="speculative") for i, p in enumerate(prompts)]
    alone = SpeculativeEngine(target, d, rule="speculative")
    expected = [alone.generate(r.prompt_ids, 14, sampling, r.seed).tokens for r in reqs]
    assert [r.tokens for r in BatchEngine(target, d, max_batch_size=4).generate(reqs)] == expected


def test_sampled_drafts_follow_the_q_handed_to_verification(tiny_target, ids, dr):
    """The q of each slot is the distribution its draft was drawn from (chi-square on slot 0),
    and slot 1's q follows the token drawn at slot 0 (the Markov head)."""
    from components.spec.sampling import probs_from_logits

    d = dr.make(tiny_target, "hspec")
    state, _ = attached(tiny_target, d, ids[:1], 9)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    gen = torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    second: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        q0 = None
        for _ in range(300):
            prop = d.propose(state, ids[:1, 9], sampling, gen)
            tok = int(prop.tokens[0, 0])
            counts[tok] = counts.get(tok, 0) + 1
            q0 = probs_from_logits(prop.logits, sampling)[0, 0] if q0 is None else q0
            torch.testing.assert_close(prop.probs[0, 0], q0)
            second.setdefault(tok, prop.probs[0, 1])
            torch.testing.assert_close(prop.probs[0, 1], second[tok])  # slot 1's q: a function of slot 0's draw
    support = q0.nonzero().view(-1).tolist()
    assert set(counts) <= set(support) and len(support) == 4 and len(second) > 1
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * float(q0[t])) ** 2 / (n * float(q0[t])) for t in support)
    assert float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2))) > 1e-3
    first, other = list(second.values())[:2]
    assert not torch.allclose(first, other)
