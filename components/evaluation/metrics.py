"""What one method's generations measured, and how measurements are summed up and compared.

Vocabulary (as in the engine): a *round* is one draft → verify target pass; in it ``drafted``
draft tokens were proposed and ``accepted`` of them kept, and the round emitted ``accepted + 1``
tokens (the kept drafts plus the target's recovered or bonus token).

* τ (acceptance length) = mean tokens emitted per round = (Σ accepted + rounds) / rounds; 1 for
  methods that do not draft. Our engine emits its first token from the prefill (drafters need
  the prompt's hidden states before they can draft), transformers' assisted generation drafts
  from the prompt and verifies in the prefill pass; both count only drafting rounds. A round
  whose drafter proposed nothing (prompt lookup without a match) is a plain step and not a
  drafting round, as vLLM counts; ``target_forwards`` counts every pass.
* acceptance at position k = (rounds that accepted ≥ k drafts) / (rounds that reached draft k,
  i.e. drafted ≥ k and accepted ≥ k − 1): the conditional acceptance rate of the k-th draft.
* tokens/s = Σ new tokens / Σ wall seconds over the prompts; speedup = a method's tokens/s ÷
  the baseline's tokens/s measured in the same run. Both count the prompt's prefill, which
  speculation cannot shorten; where a method records when its first new token was known (our
  engines; not the peers), the split is kept too: TTFT (mean seconds to the first token) and
  decode tokens/s = Σ (new tokens − 1) / Σ (seconds − TTFT), with its own decode speedup (what
  vLLM's TPOT compares).
* lossless = every prompt's tokens equal the reference's (target-only decoding) exactly; only
  checked where the output is a function of the target and the seed (greedy, Gumbel).

Knows lists of numbers; nothing about models, engines or MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptRun:
    """One method on one prompt."""

    method: str
    prompt_id: str
    tokens: list[int]  # the new tokens (prompt excluded)
    seconds: float  # wall time of the whole generation, prefill included
    accepted: list[int] = field(default_factory=list)  # accepted drafts per drafting round ([] if no drafting)
    drafted: list[int] = field(default_factory=list)  # drafts proposed per drafting round
    target_forwards: int = 0  # target passes, prefill included (0: not counted)
    prefill_seconds: float | None = None  # until the first new token was known (None: not recorded)

    @property
    def rounds(self) -> int:
        """Drafting rounds."""
        return len(self.accepted)


@dataclass
class Mismatch:
    """Where a method's output first left the reference on one prompt."""

    prompt_id: str
    index: int  # first differing new-token index
    expected: int  # the reference's token there
    got: int  # the method's token there (-1: the output ended early)
    margin: float | None = None  # target logit(expected) - logit(got) at that position
    near_tie: bool | None = None  # |margin| below the near-tie threshold (a numerical tie)


@dataclass
class MethodSummary:
    """One method over all prompts."""

    method: str
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    tau: float
    rounds: int  # drafting rounds
    mean_drafted: float  # drafts proposed per drafting round (γ, or transformers' adaptive length)
    acceptance_by_position: list[float]  # k = 1.. (empty if the method does not draft)
    reached_by_position: list[int]  # rounds that reached draft k (the denominators)
    target_forwards: int
    ttft_s: float | None = None  # mean seconds to the first new token (None: not recorded for every prompt)
    decode_tokens_per_s: float | None = None  # tokens after the first / the seconds after it
    speedup: float | None = None  # tokens/s ÷ the reference method's (target_only)
    decode_speedup: float | None = None  # decode tokens/s ÷ the reference method's
    speedup_vs_hf_generate: float | None = None  # transformers' methods only
    speedup_vs_vllm_generate: float | None = None  # vLLM's methods only
    lossless: bool | None = None  # None: not checked (sampled rules)
    mismatches: list[Mismatch] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # method notes (γ, assistant, ...)


def tau(accepted: list[int]) -> float:
    """Mean tokens per drafting round, (Σ accepted + rounds) / rounds; 1.0 without rounds."""
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 1.0


def acceptance_by_position(accepted: list[int], drafted: list[int]) -> tuple[list[float], list[int]]:
    """(rate at k, rounds reaching k) for k = 1.. as long as some round reached k (reaching k
    implies reaching k − 1, so the positions left out are exactly those never reached)."""
    rates, reached = [], []
    for k in range(1, max(drafted, default=0) + 1):
        hits = [a >= k for a, d in zip(accepted, drafted) if d >= k and a >= k - 1]
        if not hits:
            break
        rates.append(sum(hits) / len(hits))
        reached.append(len(hits))
    return rates, reached


def summarize(method: str, runs: list[PromptRun]) -> MethodSummary:
    """Sums one method's prompt runs (same prompts as every other method)."""
    accepted = [a for r in runs for a in r.accepted]
    drafted = [d for r in runs for d in r.drafted]
    rates, reached = acceptance_by_position(accepted, drafted)
    new_tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    ttft = decode = None
    if runs and all(r.prefill_seconds is not None for r in runs):
        first = sum(r.prefill_seconds for r in runs)
        ttft = first / len(runs)
        after = seconds - first
        decode = sum(max(len(r.tokens) - 1, 0) for r in runs) / after if after > 0 else None
    return MethodSummary(
        method=method, prompts=len(runs), new_tokens=new_tokens, seconds=seconds,
        tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0, tau=tau(accepted), rounds=len(accepted),
        mean_drafted=sum(drafted) / len(drafted) if drafted else 0.0, acceptance_by_position=rates,
        reached_by_position=reached, target_forwards=sum(r.target_forwards for r in runs),
        ttft_s=ttft, decode_tokens_per_s=decode)


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a shorter output differs where it ends); None if equal."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_tokens(reference: list[PromptRun], runs: list[PromptRun]) -> list[Mismatch]:
    """Per prompt, where ``runs`` first differ from ``reference`` (same prompt order)."""
    out = []
    for ref, run in zip(reference, runs, strict=True):
        i = first_difference(ref.tokens, run.tokens)
        if i is not None:
            got = run.tokens[i] if i < len(run.tokens) else -1
            out.append(Mismatch(ref.prompt_id, i, ref.tokens[i] if i < len(ref.tokens) else -1, got))
    return out


def _ratio(s: MethodSummary, base: MethodSummary | None) -> float | None:
    return s.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s > 0 else None


def add_speedups(summaries: dict[str, MethodSummary], reference: str, hf_reference: str,
                 hf_methods: set[str], vllm_reference: str = "", vllm_methods: set[str] | None = None) -> None:
    """Fills ``speedup`` (÷ reference tokens/s) and, for ``hf_methods`` / ``vllm_methods``,
    ``speedup_vs_hf_generate`` / ``speedup_vs_vllm_generate`` (÷ that peer's plain decoding)."""
    base, hf_base, vllm_base = (summaries.get(reference), summaries.get(hf_reference),
                                summaries.get(vllm_reference))
    for name, s in summaries.items():
        if base is not None and base.tokens_per_s > 0:
            s.speedup = s.tokens_per_s / base.tokens_per_s
        if base is not None and base.decode_tokens_per_s and s.decode_tokens_per_s is not None:
            s.decode_speedup = s.decode_tokens_per_s / base.decode_tokens_per_s
        if name in hf_methods:
            s.speedup_vs_hf_generate = _ratio(s, hf_base)
        if name in (vllm_methods or set()):
            s.speedup_vs_vllm_generate = _ratio(s, vllm_base)
