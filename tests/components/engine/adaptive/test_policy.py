"""The adaptive draft-length policy against a simulated clock: its model, and the calibration
that keeps speculation from running slower than plain decoding when the model is wrong."""

from __future__ import annotations

import numpy as np
import torch

from components.engine.adaptive.policy import AdaptiveDraftLength, FixedDraftLength
from components.spec.cost import ProfileTable

GAMMA = 7


def run_rounds(policy, batch: int, survival: float, true_seconds, true_accept: float, rounds: int = 60):
    """Plays ``rounds`` rounds: the policy sees confidence survival ``survival``^k, the "real"
    round costs ``true_seconds(batch, cap)`` and each draft is accepted with ``true_accept``
    (expected counts, no noise). Returns the caps chosen."""
    conf = torch.full((batch, GAMMA), survival, dtype=torch.float64).cumprod(dim=-1)
    caps = []
    for _ in range(rounds):
        cap = policy.cap(conf, GAMMA)
        caps.append(cap)
        accepted = round(batch * sum(true_accept ** k for k in range(1, cap + 1)))
        per_row = [accepted // batch + (i < accepted % batch) for i in range(batch)] if cap else []
        seconds = true_seconds(batch, cap)
        policy.observe(per_row, [cap] * len(per_row), 0.2 * seconds if cap else 0.0, 0.8 * seconds,
                       seconds, batch * (cap + 1))
    return caps


def flat_table() -> ProfileTable:
    return ProfileTable([1, 4096], [1.0, 1.0])  # the model believes a wider pass is free


def test_calibration_falls_back_to_plain_when_speculation_measures_slower():
    """An over-confident head (survival 0.95 believed, 0.2 real) and a pass that really costs
    ∝ width: the uncalibrated model keeps drafting; the calibrated policy ends on plain rounds
    and its measured tokens per second reach plain decoding's."""
    def true_seconds(batch, cap):  # compute-bound: every extra token costs
        return 0.01 * batch * (cap + 1)

    blind = run_rounds(AdaptiveDraftLength(flat_table(), calibrate=False), 4, 0.95, true_seconds, 0.2)
    assert min(blind) > 0
    caps = run_rounds(AdaptiveDraftLength(flat_table()), 4, 0.95, true_seconds, 0.2)
    late = caps[20:]
    assert late.count(0) >= 0.8 * len(late)  # plain, with an occasional re-check of a cap


def test_calibration_keeps_speculating_when_it_measures_faster():
    """A memory-bound pass (cost flat in width) and a good drafter: the calibrated policy keeps
    a high cap, apart from its early and periodic plain re-checks."""
    def true_seconds(batch, cap):
        return 0.01 + (0.002 if cap else 0.0)

    policy = AdaptiveDraftLength(flat_table())
    caps = run_rounds(policy, 4, 0.9, true_seconds, 0.9)
    # plain tried once to measure its time, then only every ``recheck`` rounds (its tokens are certain)
    assert caps.count(0) <= 1 + len(caps) // policy.recheck
    assert min(c for c in caps if c) >= 4


def test_one_bad_round_does_not_keep_a_request_plain():
    """Batch 1: the first drafting round accepts nothing, so the policy goes plain, where it
    sees no confidences, only that round's acceptance. Its early re-try of drafting finds the
    drafter good again, and drafting stays on."""
    def true_seconds(batch, cap):
        return 0.02 + (0.015 if cap else 0.0)

    policy, caps, fresh = AdaptiveDraftLength(flat_table()), [], None
    for i in range(40):
        survival = fresh if fresh is not None else policy.empirical_survival(GAMMA)[None, :]
        cap = policy.cap(survival, GAMMA)
        caps.append(cap)
        accepted = [0 if i == 0 else cap] if cap else []
        seconds = true_seconds(1, cap)
        policy.observe(accepted, [cap] if cap else [], 0.01 if cap else 0.0, seconds - 0.01, seconds, cap + 1)
        fresh = torch.full((1, GAMMA), 0.9, dtype=torch.float64).cumprod(dim=-1) if cap else None
    assert caps[0] > 0 and caps[1] == 0
    assert caps[3] > 0  # drafting tried again two rounds later, and kept
    assert caps[3:].count(0) <= 5  # only the backed-off tries of plain rounds


def test_calibration_is_kept_per_batch_size():
    """Corrections learned at batch 16 do not carry to batch 1 (separate buckets)."""
    policy = AdaptiveDraftLength(flat_table())

    def wide_is_slow(batch, cap):
        return 0.001 * batch * (cap + 1) if batch > 8 else 0.01 + (0.002 if cap else 0.0)

    assert run_rounds(policy, 16, 0.95, wide_is_slow, 0.2)[-1] == 0
    assert run_rounds(policy, 1, 0.9, wide_is_slow, 0.9, rounds=5)[-1] > 0


def test_fixed_draft_length_always_drafts_the_cap():
    assert FixedDraftLength().cap(torch.ones(2, GAMMA, dtype=torch.float64), GAMMA) == GAMMA


def test_draining_batch_counts_on_easy_rows_leaving():
    """A closed batch of 16 with 4 hard rows: easy rows finish early at a deep cap and the rounds
    after them are cheaper (round time grows with the rows), so the policy drafts deeper than for
    16 hard rows, where nobody leaves early; it picks the cap of the least expected time."""
    from components.engine.adaptive.times import RoundTimes

    sizes = [1, 4, 8, 16]
    table = RoundTimes(sizes, torch.tensor([[0.015 + 0.0025 * b * (1 + 0.25 * g) for g in range(GAMMA + 1)]
                                            for b in sizes]))
    easy = torch.full((GAMMA,), 0.95, dtype=torch.float64).cumprod(dim=-1)
    hard = torch.full((GAMMA,), 0.6, dtype=torch.float64).cumprod(dim=-1)
    mixed = torch.stack([easy] * 12 + [hard] * 4)
    policy = AdaptiveDraftLength(round_time=table, calibrate=False)
    chosen = policy.cap(mixed, GAMMA, remaining=[31] * 16)
    assert chosen == int(policy._drain_seconds(mixed, [31] * 16, GAMMA).argmin())
    all_hard = AdaptiveDraftLength(round_time=table, calibrate=False).cap(torch.stack([hard] * 16), GAMMA,
                                                                           remaining=[31] * 16)
    assert chosen > all_hard > 0


def test_draining_batch_follows_the_row_that_finishes_last():
    """16 rows, 15 of them accepting well and one hardly at all, with a round at the full cap
    costing 3.5 plain rounds: for tokens per second drafting wins; for a batch that is draining
    (no request waiting), the poor row would need about as many rounds as plain decoding, each
    3.5 times dearer, so the policy plays plain rounds. At batch 1 both objectives agree."""
    from components.engine.adaptive.times import RoundTimes

    seconds = [0.037] + [0.037 * (1 + 2.5 * g / GAMMA) for g in range(1, GAMMA + 1)]
    table = RoundTimes([16], torch.tensor([seconds]))
    survival = torch.full((16, GAMMA), 0.95, dtype=torch.float64).cumprod(dim=-1)
    survival[3] = torch.full((GAMMA,), 0.05, dtype=torch.float64).cumprod(dim=-1)
    assert AdaptiveDraftLength(round_time=table).cap(survival, GAMMA) > 0
    assert AdaptiveDraftLength(round_time=table).cap(survival, GAMMA, remaining=[31] * 16) == 0
    one = RoundTimes([1], torch.tensor([[0.02] + [0.03] * GAMMA]))
    good = torch.full((1, GAMMA), 0.9, dtype=torch.float64).cumprod(dim=-1)
    assert (AdaptiveDraftLength(round_time=one).cap(good, GAMMA)
            == AdaptiveDraftLength(round_time=one).cap(good, GAMMA, remaining=[20]) == GAMMA)


def test_calibration_learns_deep_drafts_conditionally():
    """Rows that take a loop whole or not at all (of 10: 5 accept all 7 drafts, 2 accept one, 3
    none): P(draft k | the ones before) is 0.7, 5/7, then 1. A head saying 0.7 at every position
    predicts survival 0.7^7 ≈ 0.08 at position 7; calibrated conditionally, the policy expects
    about the 0.5 the rows really reach, and the first position stays at 0.7."""
    policy = AdaptiveDraftLength(flat_table())
    conf = torch.full((10, GAMMA), 0.7, dtype=torch.float64).cumprod(dim=-1)
    truth = [7] * 5 + [1] * 2 + [0] * 3
    for _ in range(40):
        cap = policy.cap(conf, GAMMA)
        drafted = [cap] * 10 if cap else []
        policy.observe([min(t, cap) for t in truth][:len(drafted)], drafted, 0.1, 0.8, 1.0, 10 * (cap + 1))
    est = policy.calibrated(conf)[0]
    assert abs(float(est[0]) - 0.7) < 0.03 and abs(float(est[1]) - 0.5) < 0.05
    assert 0.42 < float(est[6]) <= float(est[1]) and float(conf[0, 6]) < 0.1



def test_deep_positions_seen_only_in_hard_rows_do_not_lower_every_row():
    """Deep drafts are seen only in rounds of hard rows (2 of 10 take the whole loop, 8 none);
    rounds of mixed rows draft 3. Every row that reaches a draft accepts it after the first,
    so calibrated survival stays flat past position 1, for every row, instead of carrying the
    hard rows' low P(all 7) over to the positions only they were seen at."""
    policy = AdaptiveDraftLength(flat_table())
    conf = torch.full((10, GAMMA), 0.7, dtype=torch.float64).cumprod(dim=-1)
    mixed = [3] * 7 + [0] * 3  # drafting 3: 7 of 10 take it whole
    hard = [7] * 2 + [0] * 8
    for i in range(40):
        accepted, drafted = (mixed, [3] * 10) if i % 2 else (hard, [GAMMA] * 10)
        policy.cap(conf, GAMMA)
        policy.observe(accepted, drafted, 0.1, 0.8, 1.0, 10 * (max(drafted) + 1))
    est = policy.calibrated(conf)[0]
    assert float(est[GAMMA - 1]) > 0.95 * float(est[2]) and 0.35 < float(est[0]) < 0.5


def test_cap_is_the_best_cap_by_brute_force():
    """Uncalibrated, the cap maximises the expected tokens per second of the round model
    s·T(B·(G+1)) + o + [G > 0]·t_draft over every cap 0..γ (DSpark's objective with one cap per
    padded pass), on random survivals and forward curves: no fixed draft length beats it on its
    own objective."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(30):
        bsz = int(torch.randint(1, 12, (1,), generator=gen))
        survival = (torch.rand(bsz, GAMMA, generator=gen, dtype=torch.float64) ** 0.3).cumprod(-1)
        xs = torch.arange(1, bsz * (GAMMA + 1) + 1, dtype=torch.float64)
        knee = float(torch.randint(1, bsz * (GAMMA + 1), (1,), generator=gen))
        table = ProfileTable(xs, 0.01 * torch.maximum(torch.ones_like(xs), xs / knee))  # flat, then ∝ n
        policy = AdaptiveDraftLength(table, calibrate=False, overhead=0.002, draft_seconds=0.003)

        def rate(g: int, bsz=bsz, survival=survival, table=table) -> float:
            seconds = float(table(float(bsz * (g + 1)))) + 0.002 + (0.003 if g else 0.0)
            return (bsz + float(survival[:, :g].sum())) / seconds

        best = max(rate(g) for g in range(GAMMA + 1))
        assert rate(policy.cap(survival, GAMMA)) >= best * (1 - 1e-12)


def test_light_load_drafts_fully_heavy_load_plainly():
    """A free verify pass: the full cap for a confident and an unsure request alike; a pass
    whose time is proportional to its width: plain rounds (no drafted token is worth its slot)."""
    survival = torch.tensor([[0.99, 0.97, 0.95, 0.9], [0.6, 0.3, 0.1, 0.05]], dtype=torch.float64)
    flat = ProfileTable([1, 1000], [0.02, 0.02])
    assert AdaptiveDraftLength(flat, calibrate=False).cap(survival, 4) == 4
    busy = ProfileTable([1, 1000], [0.001, 1.0])  # compute-bound: every extra token costs
    assert AdaptiveDraftLength(busy, calibrate=False).cap(survival, 4) == 0


def _profile_8(per_token: float = 0.0015):
    """A round profile at batch 8: 24 ms plain, each drafted token of the pass (8·G of them,
    every row drafting G) ``per_token`` seconds more."""
    from components.engine.adaptive.times import RoundTimes

    return RoundTimes([8], torch.tensor([[0.024 + per_token * 8 * g for g in range(GAMMA + 1)]], dtype=torch.float64))


def _one_row_previewing(length: int = 4, conf: float = 0.95) -> torch.Tensor:
    """Survival [8, γ]: one row previews a confident draft of ``length`` (0 past it, as a
    drafter declaring PREVIEWS gives), seven rows will propose nothing."""
    survival = torch.zeros(8, GAMMA, dtype=torch.float64)
    survival[0, :length] = torch.full((length,), conf, dtype=torch.float64).cumprod(dim=0)
    return survival


def test_a_ragged_pass_prices_the_drafts_it_will_verify():
    """Eight rows, one with a confident 4-token suffix draft, the others with nothing to draft.
    Priced as the profile measured it (every row drafting the cap: 32 more tokens at cap 4) the
    draft cannot pay; a slot cache verifies each row's own tokens (4 more at cap 4), and a
    padded pass is as wide as its longest row: the same draft pays in the first and not in the
    second, where its 28 padding slots cost as much as drafting in every row."""
    survival = _one_row_previewing()
    ragged = AdaptiveDraftLength(round_time=_profile_8(), ragged=True, calibrate=False)
    padded = AdaptiveDraftLength(round_time=_profile_8(), calibrate=False)
    assert ragged.cap(survival, GAMMA) == 4  # past its draft a cap adds nothing, at no cost: the least of the best
    assert padded.cap(survival, GAMMA) == 0
    # every row drafting fully: the width is the cap, ragged or not, and the choice is the same
    full = torch.full((8, GAMMA), 0.95, dtype=torch.float64).cumprod(dim=-1)
    assert ragged.cap(full, GAMMA) == padded.cap(full, GAMMA)
    np_width = ragged._width((survival.numpy() > 0).sum(axis=1), GAMMA)
    assert list(np_width) == [0.0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5]


def test_a_ragged_round_is_measured_at_its_own_width():
    """A played round's correction is taken against the profile read at the width it had
    (drafts per row): a round as the profile predicts it leaves it at 1. Its seconds are kept as
    the measured time of a width only where that is a whole number of drafts per row."""
    policy = AdaptiveDraftLength(round_time=_profile_8(), ragged=True)
    assert policy.cap(_one_row_previewing(), GAMMA) == 4
    seconds = 0.024 + 0.0015 * 4  # one row verified 4 drafts: width 0.5
    policy.observe([3], [4], 0.0, seconds, seconds, 8 * 5)
    assert policy.round_times == {} and abs(policy.corrections[(8, True)] - 1.0) < 1e-9
    every = torch.full((8, GAMMA), 0.95, dtype=torch.float64).cumprod(dim=-1)
    assert policy.cap(every, GAMMA) == 0  # plain, tried once: its time here, not the profile's
    policy.observe([], [], 0.0, 0.024, 0.024, 8)
    cap = policy.cap(every, GAMMA)
    policy.observe([cap] * 8, [cap] * 8, 0.0, 0.05, 0.05, 8 * (cap + 1))
    assert cap > 0 and policy.round_times == {(8, 0): 0.024, (8, cap): 0.05}


def test_a_ragged_batch_drafts_only_the_rows_whose_drafts_pay():
    """Eight rows, four confident and four unsure, each draft slot costing half a plain token
    (the profile: 24 ms plain, 1.5 ms a row-token). On a slot cache each row pays for its own
    drafts: the confident rows draft, the unsure ones (first draft 0.3 < 0.5) stay plain. A
    padded pass is as wide as its longest row, so there every row drafts the cap. Unsure rows
    alone: no row drafts."""
    sure = torch.full((4, GAMMA), 0.95, dtype=torch.float64).cumprod(dim=-1)
    unsure = torch.full((4, GAMMA), 0.3, dtype=torch.float64).cumprod(dim=-1)
    ragged = AdaptiveDraftLength(round_time=_profile_8(), ragged=True, calibrate=False)
    cap = ragged.cap(torch.cat([sure, unsure]), GAMMA)
    assert cap > 0 and ragged.row_lengths[4:] == [0] * 4 and min(ragged.row_lengths[:4]) == cap
    padded = AdaptiveDraftLength(round_time=_profile_8(), calibrate=False)
    cap = padded.cap(torch.cat([sure, unsure]), GAMMA)
    assert padded.row_lengths == [cap] * 8
    only_unsure = torch.full((8, GAMMA), 0.3, dtype=torch.float64).cumprod(dim=-1)
    assert ragged.cap(only_unsure, GAMMA) == 0 or ragged.row_lengths == [0] * 8


def test_a_row_drafts_the_length_that_pays_as_a_whole():
    """A row's length maximises its expected tokens over their slots' price: the first draft
    carries the round's drafting cost (here 12 ms against 4 ms for each one after it, 24 ms a
    plain round at batch 8: prices 0.5 and 1/6 of a plain token), so a first draft a little under
    its price is drafted when the ones after it make up for it, and drafting stops where the
    next draft's acceptance falls under its price."""
    from components.engine.adaptive.times import RoundTimes

    steps = [0.0, 0.012] + [0.004] * (GAMMA - 1)
    profile = RoundTimes([8], torch.from_numpy(np.cumsum(steps)[None, :] + 0.024))
    policy = AdaptiveDraftLength(round_time=profile, ragged=True, calibrate=False)
    priced = policy._priced(8, GAMMA)
    assert list(policy._worth(np.array([[0.45, 0.4, 0.35, 0.3, 0.1, 0.05, 0.0]]), priced)) == [4]
    assert list(policy._worth(np.array([[0.3, 0.15, 0.1, 0.0, 0.0, 0.0, 0.0]]), priced)) == [0]


def test_a_stalled_pass_moves_a_price_no_more_than_a_slow_round():
    """A plain round whose pass stalls (the OS, a page fault: ten times its seconds) counts as a
    round ``spike`` times its price at most, so drafts that do not pay at the profile's prices
    are still not worth drafting after it (a plain round priced at the stall's seconds would
    make every cap look cheap, and plain rounds, whose tokens are certain, are not tried again
    soon)."""
    policy = AdaptiveDraftLength(round_time=_profile_8(per_token=0.006))  # a draft's slot: 2 plain tokens
    unsure = torch.full((8, GAMMA), 0.2, dtype=torch.float64).cumprod(dim=-1)

    def best_cap() -> int:  # the model's choice (``cap`` may try the other side instead)
        tokens = 8 + np.concatenate([[0.0], np.cumsum(unsure.numpy().sum(axis=0))])
        return int((tokens / policy._priced(8, GAMMA)).argmax())

    assert policy.cap(unsure, GAMMA) == 0 and best_cap() == 0
    plain = float(policy._priced(8, GAMMA)[0])
    policy.observe([], [], 0.0, 10 * plain, 10 * plain, 8)
    assert plain < policy.round_times[(8, 0)] <= policy.spike * plain + 1e-12
    for _ in range(3):  # stalls in a row climb by at most (1 − ema + ema·spike) each
        before = policy.round_times[(8, 0)]
        assert best_cap() == 0
        policy.cap(unsure, GAMMA)
        policy.observe([], [], 0.0, 10 * before, 10 * before, 8)
        climb = 1 - policy.calibration_ema + policy.calibration_ema * policy.spike
        assert policy.round_times[(8, 0)] <= before * climb + 1e-12


def test_a_profile_from_a_slower_hour_is_corrected_by_one_plain_round():
    """The profile (measured once per host) prices a plain round at 10 ms and 3 drafts at 13 ms;
    today a plain round takes 5 ms and the drafts as profiled. At the profile's prices 3 drafts
    pay, at today's they do not. Plain is tried in the first rounds, once, and its measured time
    turns the policy plain (apart from its backed-off tries of drafting); not trying it would
    have drafted every round, plain never measured."""
    from components.engine.adaptive.times import RoundTimes

    profile = RoundTimes([1], torch.tensor([[0.010, 0.011, 0.012, 0.013]], dtype=torch.float64))
    policy, caps = AdaptiveDraftLength(round_time=profile), []
    confident = torch.tensor([[0.6, 0.36, 0.216]], dtype=torch.float64)  # 2.18 tokens at cap 3
    for _ in range(80):
        cap = policy.cap(confident, 3)
        caps.append(cap)
        seconds = 0.005 if cap == 0 else 0.010 + 0.001 * cap
        accepted = [round(float(confident[0, :cap].sum()))] if cap else []
        policy.observe(accepted, [cap] if cap else [], 0.001 if cap else 0.0, seconds, seconds, cap + 1)
    assert caps[0] == 3 and 0 in caps[1:3]  # drafting at the profile's prices, then the plain try
    assert abs(policy.round_times[(1, 0)] - 0.005) < 1e-12
    assert caps[10:].count(0) >= 0.8 * len(caps[10:])

