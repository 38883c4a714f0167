"""Continuous batching is lossless and batch-independent: every request's output equals what the
target (greedy) or the batch-1 engine (sampling, same seed) produces for it alone, whatever else
shares its verification passes, whenever it joins, however many drafts each row accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.engine import (
    PromptLookupDrafter,
    SpeculativeEngine,
    SuffixDrafter,
    target_only_generate,
)
from components.engine.batch import BatchEngine, Request
from components.spec.sampling import SamplingParams
from tests.components.engine.doubles import ScriptedDrafter
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
    assert 0 < stats["prefill_share"] and 0 < stats["verify_share"] and stats["prefill_share"] + stats["verify_share"] <= 1
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


def sampled_alone_and_batched(target, rule: str) -> tuple[list[list[int]], list[list[int]]]:
    """(each sampled request through the batch-1 engine alone, all of them through the batch
    engine, 4 rows), a random DSpark drafting, on ``target``."""
    drafter = random_drafter(target, "dspark")
    sampling = SamplingParams(temperature=0.9)
    reqs = requests(target, rule=rule, sampling=sampling)
    for i, r in enumerate(reqs):
        r.seed = 100 + i
    single = SpeculativeEngine(target, drafter, rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, sampling, r.seed).tokens for r in reqs]
    return expected, [r.tokens for r in BatchEngine(target, drafter, max_batch_size=4).generate(reqs)]


@pytest.mark.parametrize("rule", ["speculative", "gumbel", "block"])
def test_batch_sampling_matches_single_request_engine(tiny_target, rule):
    """Per-request randomness: same seed → same tokens as the batch-1 engine, in any batch."""
    expected, got = sampled_alone_and_batched(tiny_target, rule)
    assert got == expected


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


def test_adaptive_draft_length_is_lossless_and_shrinks_under_load(tiny_target, greedy_refs):
    """With round times that grow with the pass width (B·(G+1)), the cap is 0 (plain decoding)
    from the first round; with flat ones it is the full cap; output stays the target's. The
    rounds are priced by profiles built for the purpose, not by the clock, and the flat case's
    drafter has fixed confidences: the choices rest on the model alone (steep: any survival
    below 1 loses to plain; flat: the longest row decides, drafting fully until its last rounds)."""
    from components.engine.adaptive.policy import AdaptiveDraftLength
    from components.engine.adaptive.times import RoundTimes

    refs = [r.prompt_ids + ref for r, ref in zip(requests(tiny_target), greedy_refs)]
    scripted = ScriptedDrafter(refs, tiny_target.vocab_size, 4, confidence=0.9)
    for drafter, want_zero in ((random_drafter(tiny_target, "dspark"), True), (scripted, False)):
        caps, sizes = BatchEngine(tiny_target, drafter).max_cap + 1, [1, 2, 4, 8, 16]
        seconds = [[float(b * (g + 1)) if want_zero else 1.0 for g in range(caps)] for b in sizes]
        policy = AdaptiveDraftLength(round_time=RoundTimes(sizes, torch.tensor(seconds)), calibrate=False)
        engine = BatchEngine(tiny_target, drafter, draft_length=policy)  # the model alone (test_policy: calibrated)
        results = engine.generate(requests(tiny_target))
        assert [r.tokens for r in results] == greedy_refs
        assert engine.caps and (max(engine.caps) == 0) == want_zero
        if not want_zero:  # a free verify pass: always draft fully, except past the last row's end
            # (draining, drafts beyond a row's last token are worth nothing: the cap follows it down)
            assert engine.caps.count(engine.max_cap) >= len(engine.caps) - 2


class ScriptedCap:
    """A draft-length policy that plays a fixed sequence of caps (then repeats it)."""

    adapts = True
    calibrate = False
    row_lengths = None

    def __init__(self, caps):
        self.caps, self.i = list(caps), 0

    def empirical_survival(self, max_cap):
        return np.ones(max_cap)

    def cap(self, survival, max_cap, remaining=None):
        self.i += 1
        return min(self.caps[(self.i - 1) % len(self.caps)], max_cap)

    def observe(self, *args, **kwargs):
        pass


class ScriptedLengths(ScriptedCap):
    """Caps as ``ScriptedCap``, and a length of its own for each speculating row under them
    (``row_lengths``, cycling through ``lengths``), as the adaptive policy gives on a ragged pass."""

    def __init__(self, caps, lengths):
        super().__init__(caps)
        self.lengths = list(lengths)

    def cap(self, survival, max_cap, remaining=None):
        cap = super().cap(survival, max_cap)
        self.row_lengths = [self.lengths[(self.i + b) % len(self.lengths)] for b in range(survival.shape[0])]
        return cap


def test_rows_draft_their_own_lengths_under_the_cap(tiny_target, greedy_refs):
    """Each speculating row drafts the policy's length for it, at most the cap; a row given
    none is a plain row of a drafting round. Output is the target's own."""
    policy = ScriptedLengths([3], [0, 1, 2, 5])
    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=3, draft_length=policy)
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    drafted = [d for r in results for d in r.drafted]
    assert set(drafted) <= {1, 2, 3} and {1, 2, 3} <= set(drafted)  # 5 is cut to the cap, 0 drafts nothing
    assert sum(r.rounds for r in results) > len(drafted)  # rounds where a row was given no draft


def test_policy_sees_rows_left_tokens_only_when_nothing_waits(tiny_target, greedy_refs):
    """The engine tells the draft-length policy each row's tokens left once no request waits
    to join (the batch is draining), and not before."""
    seen = []

    class Recording(ScriptedCap):
        def cap(self, survival, max_cap, remaining=None):
            seen.append((bool(engine.waiting), remaining, survival.shape[0]))
            return super().cap(survival, max_cap)

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
    eager.drafting.defer_plain_updates = False
    assert [r.accepted for r in results] == [r.accepted for r in eager.generate(requests(tiny_target))]


def test_profiled_forward_time_is_non_decreasing(tiny_target):
    from components.engine.adaptive.profile import profile_forward_time

    table = profile_forward_time(tiny_target, sizes=(1, 4, 16, 32), context=8, reps=1)
    assert table.xs.tolist() == [1, 4, 16, 32] and bool((table.ys[1:] >= table.ys[:-1]).all())
    assert float(table.ys[0]) > 0


def test_a_learning_drafter_is_taught_each_finished_response_but_not_cancelled_ones(tiny_target, greedy_refs):
    drafter = SuffixDrafter(tiny_target.vocab_size, 4, max_depth=16)
    engine = BatchEngine(tiny_target, drafter, max_batch_size=3)
    reqs = requests(tiny_target)
    engine.cancel(reqs[-1].request_id)  # waits, then is cancelled before it runs
    for r in reqs:
        engine.add(r)
    done = {}
    while engine.has_work:
        done |= {o.request_id: o.result for o in engine.step() if o.finished}
    kept = sorted(drafter.responses.tree.seqs[i] for i in drafter.responses.kept.values())
    assert kept == sorted(greedy_refs[:-1])  # every response that ended, in full; not the cancelled one
    again = engine.generate(requests(tiny_target))  # drafting from what it learnt: still the target's own
    assert [r.tokens for r in again] == greedy_refs


def test_greedy_rounds_never_build_a_one_hot_proposals_distributions(tiny_target, greedy_refs):
    """A model-free drafter's q is one-hot: greedy verification compares tokens, so the [1, G, V]
    logits and probs of its proposals are never written; sampled verification reads them, and
    they are then the one-hot construction (``test_engine_zero_draft``)."""
    made = []

    class Recording(PromptLookupDrafter):
        def propose(self, *args, **kwargs):
            made.append(super().propose(*args, **kwargs))
            return made[-1]

    engine = BatchEngine(tiny_target, Recording(tiny_target.vocab_size, 4), max_batch_size=3)
    assert [r.tokens for r in engine.generate(requests(tiny_target))] == greedy_refs
    drafted = [p for p in made if p.tokens.shape[1]]
    assert drafted and all(p._logits is None and p._probs is None for p in drafted)
    made.clear()
    reqs = requests(tiny_target, sampling=SamplingParams(temperature=0.8), rule="speculative", seed=1)
    BatchEngine(tiny_target, Recording(tiny_target.vocab_size, 4), max_batch_size=3).generate(reqs)
    assert any(p._probs is not None for p in made if p.tokens.shape[1])
