"""Continuous batching is lossless and batch-independent: every request's output equals what the
target (greedy) or the batch-1 engine (sampling, same seed) produces for it alone, whatever else
shares its verification passes, whenever it joins, however many drafts each row accepts."""

from __future__ import annotations

import pytest
import torch

from components.engine import PromptLookupDrafter, SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.engine.batch_cache import RaggedCache
from components.spec.sampling import SamplingParams
from tests.components.engine.test_engine_carryover import carry_drafter
from tests.components.engine.test_engine_greedy import random_drafter

TEXTS = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
         "for i in range(10):\n    ", "x", "    return self._value + other._value  # sum\n"]


def batch_prompts(target) -> list[list[int]]:
    return [target.tokenizer(t)["input_ids"] for t in TEXTS]


def requests(target, lengths=(20, 7, 31, 12, 1, 25), **kw) -> list[Request]:
    return [Request(p, n, **kw) for p, n in zip(batch_prompts(target), lengths)]


@pytest.mark.parametrize("drafter_kind", ["plain", "dspark", "eagle3", "prompt_lookup"])
@pytest.mark.parametrize("max_batch", [2, 16])
def test_batch_greedy_equals_target(tiny_target, greedy_refs, drafter_kind, max_batch):
    drafter = {"plain": None, "prompt_lookup": PromptLookupDrafter(tiny_target.vocab_size, 4)}.get(
        drafter_kind) if drafter_kind in ("plain", "prompt_lookup") else random_drafter(tiny_target, drafter_kind)
    engine = BatchEngine(tiny_target, drafter, max_batch_size=max_batch)
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert all(r.finish_reason == "length" for r in results)
    assert not engine.has_work and engine.batch.cache is None  # everything freed
    stats = engine.stats.summary()
    assert stats["tokens"] == sum(map(len, greedy_refs)) and stats["finished"] == len(greedy_refs)
    assert 1 <= stats["mean_batch"] <= max_batch
    if drafter is not None:
        assert all(r.target_forwards == r.rounds + 1 for r in results)
        drafting = [(a, d) for r in results for a, d in zip(r.accepted, r.drafted)]
        assert stats["tau"] == pytest.approx(1 + sum(a for a, _ in drafting) / len(drafting))


def test_mixed_plain_and_speculative_rows(tiny_target, greedy_refs):
    reqs = requests(tiny_target)
    for i, r in enumerate(reqs):
        r.speculate = i % 2 == 0
    results = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=3).generate(reqs)
    assert [r.tokens for r in results] == greedy_refs
    assert all(not r.accepted for i, r in enumerate(results) if i % 2)  # plain rows never drafted


@pytest.mark.parametrize("rule", ["speculative", "gumbel", "block"])
def test_batch_sampling_matches_single_request_engine(tiny_target, rule):
    """Per-request randomness: same seed → same tokens as the batch-1 engine, in any batch."""
    drafter = random_drafter(tiny_target, "dspark")
    sampling = SamplingParams(temperature=0.9)
    reqs = requests(tiny_target, rule=rule, sampling=sampling)
    for i, r in enumerate(reqs):
        r.seed = 100 + i
    single = SpeculativeEngine(tiny_target, drafter, rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, sampling, r.seed).tokens for r in reqs]
    got = BatchEngine(tiny_target, drafter, max_batch_size=4).generate(reqs)
    assert [r.tokens for r in got] == expected


def test_greedy_rows_verified_together_beside_sampled_rows(tiny_target, greedy_refs):
    """Greedy rows (verified in one call per round) share the batch with sampled rows (verified
    one by one with their own randomness): each gets what it would get alone."""
    drafter = random_drafter(tiny_target, "dspark")
    sampling = SamplingParams(temperature=0.9)
    greedy, sampled = requests(tiny_target), requests(tiny_target, rule="speculative", sampling=sampling)
    for i, r in enumerate(sampled):
        r.seed = 7 + i
    single = SpeculativeEngine(tiny_target, drafter, rule="speculative")
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, sampling, r.seed).tokens for r in sampled]
    mixed = [r for pair in zip(greedy, sampled) for r in pair]
    got = [r.tokens for r in BatchEngine(tiny_target, drafter, max_batch_size=4).generate(mixed)]
    assert got[0::2] == greedy_refs and got[1::2] == expected


def test_plain_sampling_rows_match_target_only(tiny_target):
    sampling = SamplingParams(temperature=1.0, top_k=50)
    reqs = requests(tiny_target, rule="speculative", sampling=sampling)
    expected = [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, sampling, r.seed,
                                     rule="speculative").tokens for r in reqs]
    assert [r.tokens for r in BatchEngine(tiny_target, None).generate(reqs)] == expected


@pytest.mark.parametrize("loop_stages, carryover", [(1, True), (3, False), (2, True)])
def test_batch_dloop_and_carryover_lossless(tiny_target, greedy_refs, loop_stages, carryover):
    drafter = carry_drafter(tiny_target, "dspark", carryover=carryover)
    engine = BatchEngine(tiny_target, drafter, loop_stages=loop_stages, loop_gate=float("-inf"),
                         carryover=carryover, max_batch_size=4)
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    if carryover:
        assert any(sum(r.carried) for r in results)


def test_stop_tokens_end_a_request_and_keep_the_stop_token(tiny_target, greedy_refs):
    reqs = requests(tiny_target)
    stops = {}
    for i, (r, ref) in enumerate(zip(reqs, greedy_refs)):
        if len(ref) > 3:
            stops[i] = ref[len(ref) // 2]
            r.stop_token_ids = (stops[i],)
    results = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark")).generate(reqs)
    for i, (res, ref) in enumerate(zip(results, greedy_refs)):
        if i in stops:
            cut = ref.index(stops[i]) + 1
            assert res.tokens == ref[:cut] and res.finish_reason == "stop"
        else:
            assert res.tokens == ref


def test_cancel_frees_rows_and_others_continue(tiny_target, greedy_refs):
    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"))
    reqs = requests(tiny_target)
    for r in reqs:
        engine.add(r)
    done = {}

    def collect(outs):
        done.update({o.request_id: o.result.tokens for o in outs if o.finished and o.result})
        return outs

    collect(engine.step() + engine.step())
    victim = reqs[2].request_id
    engine.cancel(victim)
    cancelled = [o for o in collect(engine.step()) if o.request_id == victim]
    assert cancelled and cancelled[0].finished and cancelled[0].finish_reason == "cancelled"
    assert victim not in engine.running and engine.batch.cache.batch_size == len(engine.running)
    assert len(done[victim]) < reqs[2].max_new_tokens
    while engine.has_work:
        collect(engine.step())
    for r, ref in zip(reqs, greedy_refs):
        if r.request_id != victim:
            assert done[r.request_id] == ref


def test_ragged_cache_compaction_keeps_attention_exact(tiny_target):
    """Left padding is invisible (each row's next-token logits equal a plain forward of its own
    tokens), and ``compact`` moves holes away without changing what any row sees."""
    prompts = batch_prompts(tiny_target)[:3]
    ragged = None
    for p in prompts:
        part = RaggedCache.single(tiny_target.forward(torch.tensor([p]), use_cache=True).cache)
        ragged = part if ragged is None else (ragged.concat(part) or ragged)

    def next_logits(cache: RaggedCache) -> torch.Tensor:  # [B, V] after one more token (7) per row
        lens = cache.valid.sum(dim=1)
        ids = torch.full((cache.batch_size, 1), 7)
        out = tiny_target.forward(ids, attention_mask=cache.attention_mask(1), cache=cache.cache,
                                  use_cache=True, position_ids=lens[:, None])
        cache.commit(torch.zeros(cache.batch_size, 1, dtype=torch.bool))  # drop the probe again
        return out.logits[:, 0]

    exact = next_logits(ragged)
    for b, p in enumerate(prompts):
        ref = tiny_target.forward(torch.tensor([p + [7]])).logits[:, -1]
        torch.testing.assert_close(exact[b:b + 1], ref, atol=1e-5, rtol=1e-5)
    assert ragged.holes() > 0 and ragged.reclaimable() == 0  # left padding only: nothing to gain
    ragged.valid[0, -2] = False  # punch a hole in row 0
    counts = [len(p) - (b == 0) for b, p in enumerate(prompts)]
    assert ragged.reclaimable() == pytest.approx(1 - max(counts) / max(len(p) for p in prompts))
    before = next_logits(ragged)
    ragged.compact()
    after = next_logits(ragged)
    assert ragged.holes() > 0 and int(ragged.valid[0].sum()) == len(prompts[0]) - 1
    torch.testing.assert_close(before, after, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before[0], exact[0], atol=1e-4)  # the hole was masked out


def test_adaptive_draft_length_is_lossless_and_shrinks_under_load(tiny_target, greedy_refs):
    """With a forward time that grows steeply with the pass width, the cap drops to 0 (plain
    decoding) for a wide batch and stays > 0 with a flat one; output stays the target's."""
    from components.engine.schedule import AdaptiveDraftLength
    from components.spec.cost import ProfileTable

    steep = ProfileTable([1, 8, 64, 512], [1.0, 8.0, 64.0, 512.0])  # compute-bound: T ∝ n
    flat = ProfileTable([1, 512], [1.0, 1.0])  # memory-bound: T constant
    drafter = random_drafter(tiny_target, "dspark")
    for table, want_zero in ((steep, True), (flat, False)):
        policy = AdaptiveDraftLength(table, calibrate=False)  # the model alone (test_schedule: calibrated)
        engine = BatchEngine(tiny_target, drafter, draft_length=policy)
        results = engine.generate(requests(tiny_target))
        assert [r.tokens for r in results] == greedy_refs
        drafting = sum(c > 0 for c in engine.caps)  # the optimistic first guess may draft a round or two
        assert engine.caps and (drafting <= 2) == want_zero
        if not want_zero:  # a free verify pass: always draft fully, except past the last row's end
            # (draining, drafts beyond a row's last token are worth nothing: the cap follows it down)
            assert engine.caps.count(engine.max_drafts) >= len(engine.caps) - engine.max_drafts


def test_consume_many_equals_consume_per_row(tiny_target):
    """The batch engine's one-call consume keeps each row's context exactly as ``consume`` would."""
    drafter = random_drafter(tiny_target, "dspark")
    states, tokens, hidden = [], [], []
    for i, p in enumerate(batch_prompts(tiny_target)[:3]):
        out = tiny_target.forward(torch.tensor([p]), layer_ids=drafter.layer_ids)
        cut = len(p) - 1 - i  # different context lengths and new-token counts per row
        states.append(drafter.consume(drafter.init_state(1), torch.tensor([p[:cut]]), out.hidden[:, :cut]))
        tokens.append(torch.tensor([p[cut:]]))
        hidden.append(out.hidden[:, cut:])
    many = drafter.consume_many(states, tokens, hidden)
    for state, t, h, got in zip(states, tokens, hidden, many):
        want = drafter.consume(state, t, h)
        assert got.length == want.length
        for (k1, v1), (k2, v2) in zip(got.kv, want.kv):
            torch.testing.assert_close(k1, k2, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-6, rtol=1e-5)


class ScriptedCap:
    """A draft-length policy that plays a fixed sequence of caps (then repeats it)."""

    calibrate = False

    def __init__(self, caps):
        self.caps, self.i = list(caps), 0

    def empirical_survival(self, gamma):
        return torch.ones(gamma, dtype=torch.float64)

    def cap(self, survival, max_drafts, remaining=None):
        self.i += 1
        return min(self.caps[(self.i - 1) % len(self.caps)], max_drafts)

    def observe(self, *args, **kwargs):
        pass


def test_policy_sees_rows_left_tokens_only_when_nothing_waits(tiny_target, greedy_refs):
    """The engine tells the draft-length policy each row's tokens left once no request waits
    to join (the batch is draining), and not before."""
    seen = []

    class Recording(ScriptedCap):
        def cap(self, survival, max_drafts, remaining=None):
            seen.append((bool(engine.waiting), remaining, survival.shape[0]))
            return super().cap(survival, max_drafts)

    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=3,
                         draft_length=Recording([3]))
    assert [r.tokens for r in engine.generate(requests(tiny_target))] == greedy_refs
    assert all(rem is None for waiting, rem, _ in seen if waiting)
    draining = [(rem, rows) for waiting, rem, rows in seen if not waiting]
    assert draining and all(len(rem) == rows and min(rem) >= 1 for rem, rows in draining)


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_plain_rounds_defer_the_drafter_update_losslessly(tiny_target, greedy_refs, name):
    """Cap-0 rounds leave the drafter's context to be consumed when drafting resumes; the output
    stays the target's and the resumed drafts see the same context as never-deferred ones."""
    drafter = random_drafter(tiny_target, name)
    engine = BatchEngine(tiny_target, drafter, max_batch_size=3, draft_length=ScriptedCap([0, 0, 3, 0, 7]))
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert any(r.accepted for r in results) and 0 in engine.caps
    # Same drafts as an engine that consumes every round: compare the proposals' acceptance
    eager = BatchEngine(tiny_target, drafter, max_batch_size=3, draft_length=ScriptedCap([0, 0, 3, 0, 7]))
    eager.defer_plain_updates = False
    assert [r.accepted for r in results] == [r.accepted for r in eager.generate(requests(tiny_target))]


def test_profiled_forward_time_is_non_decreasing(tiny_target):
    from components.engine.schedule import profile_forward_time

    table = profile_forward_time(tiny_target, sizes=(1, 4, 16, 32), context=8, reps=1)
    assert table.xs.tolist() == [1, 4, 16, 32] and bool((table.ys[1:] >= table.ys[:-1]).all())
    assert float(table.ys[0]) > 0


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_propose_many_equals_propose_per_row(tiny_target, name):
    """One padded, masked drafter pass for all rows gives each row's own proposal."""
    from components.spec.sampling import SamplingParams

    drafter = carry_drafter(tiny_target, name)
    states, last = [], []
    for i, p in enumerate(batch_prompts(tiny_target)[:3]):
        out = tiny_target.forward(torch.tensor([p]), layer_ids=drafter.layer_ids)
        state = drafter.consume(drafter.init_state(1), torch.tensor([p[:-1]]), out.hidden[:, :-1])
        if i == 1:  # one row with carryover context
            state = drafter.with_carry(state, out.hidden[:, -3:], state.length)
        states.append(state)
        last.append(p[-1])
    greedy = SamplingParams(temperature=0.0)
    many = drafter.propose_many(states, torch.tensor(last), greedy, 3)
    for state, tok, got in zip(states, last, many):
        want = drafter.propose(state, torch.tensor([tok]), greedy, num_drafts=3)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.states, want.states, atol=1e-4, rtol=1e-4)
    # sampled rows, each with its own temperature and generator: the draws propose() makes
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7)]
    many = drafter.propose_many(states, torch.tensor(last), samplings, 3,
                                generators=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    for state, tok, sampling, seed, got in zip(states, last, samplings, (1, 2, 3), many):
        want = drafter.propose(state, torch.tensor([tok]), sampling, torch.Generator().manual_seed(seed), 3)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.probs, want.probs, atol=1e-4, rtol=1e-4)
