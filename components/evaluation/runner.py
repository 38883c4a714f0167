"""Runs every method on the same prompts in one process and checks them against the reference.

Order: one untimed warmup generation per method (first prompt, a few tokens), then prompt by
prompt every method in turn, the order rotated by one each prompt, so a slow spell of a shared
machine falls on all methods alike rather than on whichever ran last. torch's CPU thread count
is set to ``eval.threads`` while timing and restored afterwards.

Lossless: where the output must be a function of (target, seed) (``methods.exact_methods``),
each method's tokens are compared with target_only's per prompt. A mismatch is kept (prompt,
first index, both tokens) and explained: the target's logit margin between the two tokens at that
position, computed afresh; below the near-tie threshold it is a numerical tie (batched
verification and one-token decoding round differently): ``NEAR_TIE``, or ``TIE_ULPS`` units of
the target dtype's rounding at the logits' size where that is larger (bfloat16 logits of ~20 are
multiples of 0.125, so two of them can swap order between a multi-token pass and a one-token
step), otherwise a real bug (``got = -1``: the output ended
early, e.g. at a stop token). Mismatches are logged as errors.

vLLM peers (``vllm_peers``): prepared before any timing (a missing vLLM environment or drafter
stops the stage there), run in one vLLM subprocess after ours (so the two never share the CPU),
and then summarized and checked like every other method. A vLLM method vLLM refuses is kept in
``EvalReport.unavailable`` with the reason, not in ``runs``. A vLLM method with an
``engine_twin`` (``vllm_drafter``: our ``drafter``) gets a per-round comparison with it
(``notes[name]["vs_engine"]``) when both ran.

Per prompt set (``prompts.prompt_set`` of each prompt id: humaneval, chat, ...): every method is
summarized again over that set's prompts alone (``EvalReport.sets``), speedups taken within the
set, lossless restricted to the set's mismatches; ``summaries`` stay the overall numbers.

Knows methods, metrics and the target's forward; nothing about MLflow or files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from components.data.prompts import Prompt
from components.evaluation.context import EvalContext, Method, MethodFn
from components.evaluation.methods import (
    METHODS,
    PEER_BASELINES,
    REFERENCE,
    build_methods,
    exact_methods,
    of_peer,
)
from components.evaluation.metrics import (
    MethodSummary,
    Mismatch,
    PromptRun,
    add_speedups,
    compare_tokens,
    summarize,
)
from components.evaluation.prompts import sets_of
from components.evaluation.vllm_peers import VllmPlan, compare_drafter, plan_vllm, run_vllm

log = logging.getLogger(__name__)
NEAR_TIE = 1e-3  # |logit(expected) - logit(got)| below this is a numerical tie (float32)
TIE_ULPS = 4  # ... or below this many rounding units of the target's dtype at the logits' magnitude
WARMUP_TOKENS = 8


@dataclass
class EvalReport:
    """Everything one evaluation measured."""

    prompts: list[Prompt]
    runs: dict[str, list[PromptRun]]  # method → one run per prompt, in prompt order
    summaries: dict[str, MethodSummary]  # method → over all prompts
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # method → why it could not run
    sets: dict[str, dict[str, MethodSummary]] = field(default_factory=dict)  # set → method → over its prompts

    @property
    def failures(self) -> list[str]:
        """Methods whose output differed from the reference where it must not."""
        return [m for m, s in self.summaries.items() if s.lossless is False]


def warm_up(methods: dict[str, MethodFn], prompt: Prompt, max_new_tokens: int) -> None:
    for fn in methods.values():
        fn(list(prompt.input_ids), min(WARMUP_TOKENS, max_new_tokens), prompt.seed)


def time_methods(methods: dict[str, MethodFn], prompts: list[Prompt], max_new_tokens: int,
                 progress: bool = True) -> dict[str, list[PromptRun]]:
    """Every method on every prompt, interleaved (rotated order per prompt), with a progress bar
    over the generations (the bar's own cost falls between timed calls, never inside one)."""
    from tqdm.auto import tqdm

    names = list(methods)
    runs: dict[str, list[PromptRun]] = {name: [] for name in names}
    with tqdm(total=len(prompts) * len(names), desc="eval: generations", unit="gen", disable=not progress) as bar:
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[: i % len(names)]:
                run = methods[name](list(prompt.input_ids), max_new_tokens, prompt.seed)
                run.method, run.prompt_id = name, prompt.prompt_id
                runs[name].append(run)
                bar.set_postfix_str(name, refresh=False)
                bar.update(1)
    return runs


@torch.no_grad()
def logit_margin(target: Any, prompt: Prompt, reference: list[int], m: Mismatch) -> tuple[float | None, float]:
    """(the target's logit of the expected token minus the method's at the mismatch position,
    the near-tie threshold there); the margin is None when the method's output ended there."""
    if m.got < 0:
        return None, NEAR_TIE
    ids = torch.tensor([list(prompt.input_ids) + reference[: m.index]], dtype=torch.long, device=target.device)
    raw = target.forward(ids).logits[0, -1]  # [V] in the target's dtype
    logits = raw.float()
    size = float(logits[[m.expected, m.got]].abs().max())
    return float(logits[m.expected] - logits[m.got]), max(NEAR_TIE, TIE_ULPS * torch.finfo(raw.dtype).eps * size)


def check_lossless(target: Any, prompts: list[Prompt], runs: dict[str, list[PromptRun]],
                   summaries: dict[str, MethodSummary], exact: set[str]) -> None:
    """Sets ``lossless`` / ``mismatches`` on the summaries of ``exact`` methods; logs failures."""
    reference = runs[REFERENCE]
    by_id = {p.prompt_id: p for p in prompts}
    refs = {r.prompt_id: r.tokens for r in reference}
    for name in exact:
        mismatches = compare_tokens(reference, runs[name])
        for m in mismatches:
            m.margin, threshold = logit_margin(target, by_id[m.prompt_id], refs[m.prompt_id], m)
            m.near_tie = m.margin is not None and abs(m.margin) < threshold
        summaries[name].lossless = not mismatches
        summaries[name].mismatches = mismatches
        if mismatches:
            ties = sum(bool(m.near_tie) for m in mismatches)
            log.error("NOT LOSSLESS: %s differs from %s on %d of %d prompts (%d at near-ties: |margin| < %g or "
                      "%d rounding units of the target dtype); first: %s", name, REFERENCE, len(mismatches),
                      len(prompts), ties, NEAR_TIE, TIE_ULPS, mismatches[0])


def time_in_process(ctx: EvalContext, names: list[str], prompts: list[Prompt]) -> dict[str, list[PromptRun]]:
    """Our and transformers' methods among ``names`` built, warmed up and timed (interleaved) at
    ``eval.threads``: built at them too, as what a method measures when built (a round profile)
    must be measured as it will run."""
    threads = torch.get_num_threads()
    if ctx.ev.threads > 0:
        torch.set_num_threads(ctx.ev.threads)
    try:
        methods = build_methods(ctx, names)
        if ctx.ev.warmup:
            warm_up(methods, prompts[0], ctx.ev.max_new_tokens)
        return time_methods(methods, prompts, ctx.ev.max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def compare_with_engine(ctx: EvalContext, methods: dict[str, Method], runs: dict[str, list[PromptRun]]) -> None:
    """For each vLLM method whose ``engine_twin`` (our method with the same drafter) ran too:
    ``notes[name]["vs_engine"]``, vLLM's acceptance length beside our engine's τ."""
    for name, method in methods.items():
        twin = method.engine_twin
        if twin and name in runs and twin in runs:
            gamma = ctx.notes.get(twin, {}).get("num_speculative_tokens") or ctx.notes[name]["num_speculative_tokens"]
            ctx.notes[name]["vs_engine"] = compare_drafter(runs[twin], runs[name], gamma)


def time_all(ctx: EvalContext, names: list[str],
             prompts: list[Prompt]) -> tuple[dict[str, list[PromptRun]], dict[str, str]]:
    """(runs per method in ``names`` order, unavailable method → why): ours in this process,
    then vLLM's in its subprocess (planned, i.e. exported, before any timing)."""
    peers = {n: METHODS[n] for n in names if METHODS[n].in_vllm}
    plan: VllmPlan | None = plan_vllm(ctx, peers) if peers else None
    unavailable: dict[str, str] = {}
    try:
        runs = time_in_process(ctx, names, prompts)
        if plan is not None:
            vruns, unavailable = run_vllm(ctx, plan, prompts)
            runs = {m: vruns[m] if m in vruns else runs[m] for m in names if m in runs or m in vruns}
            compare_with_engine(ctx, peers, runs)
    finally:
        if plan is not None:
            plan.close()  # the temporary drafter export
    return runs, unavailable


def summarize_all(runs: dict[str, list[PromptRun]]) -> dict[str, MethodSummary]:
    """Every method's summary over ``runs``, with speedups (÷ target_only, ÷ the peers' own)."""
    summaries = {name: summarize(name, r) for name, r in runs.items()}
    add_speedups(summaries, REFERENCE, PEER_BASELINES["hf"], of_peer("hf", runs),
                 PEER_BASELINES["vllm"], of_peer("vllm", runs))
    return summaries


def summarize_sets(prompts: list[Prompt], runs: dict[str, list[PromptRun]],
                   overall: dict[str, MethodSummary]) -> dict[str, dict[str, MethodSummary]]:
    """Set → method → summary over that set's prompts (speedups within the set; ``lossless``
    where ``overall`` was checked, from the set's own mismatches)."""
    out = {}
    for name, ids in sets_of(prompts).items():
        keep = set(ids)
        per = summarize_all({m: [r for r in rs if r.prompt_id in keep] for m, rs in runs.items()})
        for m, s in per.items():
            if overall[m].lossless is not None:
                s.mismatches = [x for x in overall[m].mismatches if x.prompt_id in keep]
                s.lossless = not s.mismatches
        out[name] = per
    return out


def compare_methods(ctx: EvalContext, names: list[str], prompts: list[Prompt]) -> EvalReport:
    """Builds the methods, warms up, times them on ``prompts`` (vLLM's afterwards, in its own
    process), summarizes them overall and per prompt set and checks them against ``target_only``."""
    runs, unavailable = time_all(ctx, names, prompts)
    summaries = summarize_all(runs)
    precision = getattr(ctx.step, "precision", "float32")  # the fast step's (StepTarget), else float32
    exact = exact_methods(ctx.ev, list(runs), precision) - {REFERENCE}
    check_lossless(ctx.target, prompts, runs, summaries, exact)
    if precision != "float32" and ctx.ev.temperature == 0:  # the peers' float32 output beside a step that is not
        for name in set(runs) - exact - {REFERENCE}:
            differ = len({m.prompt_id for m in compare_tokens(runs[REFERENCE], runs[name])})
            summaries[name].extra["lossless"] = f"not checked: {precision} target; {differ} of {len(prompts)} prompts differ"
    for name, notes in ctx.notes.items():
        if name in summaries:
            summaries[name].extra.update(notes)
    return EvalReport(prompts, runs, summaries, dict(ctx.notes), unavailable, summarize_sets(prompts, runs, summaries))
