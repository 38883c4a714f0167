"""What every evaluation method is built from, and what the method registry says about each.

* :class:`EvalContext` -- the loaded parts the methods share (target, drafter, assistant,
  settings) and the per-method notes they leave for the report;
* :class:`Method`      -- one registry entry: how the method is built (in this process, or as a
  vLLM ``speculative_config``), whose implementation it is (``peer``: which baseline its
  peer-relative speedup is measured against, and whether it follows ``eval.rule``), and which
  parts the stage must load for it. The stage, the runner and the report read these fields
  instead of looking at method names.

The registry itself is ``methods.METHODS`` (ours and transformers') plus
``vllm_peers.VLLM_METHODS``; this module sits below both, so neither imports the other.

Knows EvalConfig and the shape of a method; nothing about engines, transformers, vLLM or reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from components.config import ConfigError, EvalConfig
from components.evaluation.metrics import PromptRun
from components.spec.sampling import SamplingParams

MethodFn = Callable[[list[int], int, int], PromptRun]  # (prompt_ids, max_new_tokens, seed) → run
Peer = Literal["ours", "hf", "vllm"]


@dataclass
class EvalContext:
    """What the methods share: one target, its drafter and assistant (if any), the settings."""

    target: Any  # components.target.Target
    ev: EvalConfig
    drafter: Any = None  # a loaded drafter (engine protocol), for methods with needs_drafter
    assistant: Any = None  # an HF causal LM with the target's tokenizer, for "hf_assisted"
    assistant_path: str | None = None  # where that assistant is (vLLM loads it: "vllm_draft_model")
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per method: γ, sizes, ...
    # the target as our engines run it (plain decoding, the chain engine, the batch engine on
    # its slab): the fast step of ``components.target.fast`` where ``target.step`` chose it,
    # else ``target`` itself
    step: Any = None
    # the target's own responses (data-stage rollouts) suffix decoding's global tree starts with
    # (``eval.suffix_rollouts``), and where they came from; none: an empty tree
    rollouts: list[list[int]] = field(default_factory=list)
    rollouts_from: str | None = None

    @property
    def chain_target(self) -> Any:
        return self.step if self.step is not None else self.target

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.ev.temperature)

    def trained_drafter(self, method: str) -> Any:
        """The loaded drafter; a ConfigError naming eval.drafter_path when there is none."""
        if self.drafter is None:
            raise ConfigError(f"eval.drafter_path: method '{method}' needs a trained drafter; set "
                              "eval.drafter_path or run the train stage first (or drop it from eval.methods)")
        return self.drafter


SpeculativeConfigFn = Callable[[EvalContext, Path], "dict[str, Any] | None"]  # (ctx, export dir) → config


@dataclass(frozen=True)
class Method:
    """One registry entry. Exactly one of ``build`` (run in this process) and
    ``speculative_config`` (run in the vLLM subprocess; None config = the target alone) is set."""

    build: Callable[[EvalContext], MethodFn] | None = None
    speculative_config: SpeculativeConfigFn | None = None
    peer: Peer = "ours"  # "ours" follows eval.rule; peers sample their own way (exact only when greedy)
    needs_drafter: bool = False  # the stage loads eval.drafter_path (or the train stage's drafter)
    needs_assistant: bool = False  # the stage loads eval.assistant
    needs_rollouts: bool = False  # suffix decoding: the stage reads eval.suffix_rollouts' responses
    engine_twin: str | None = None  # our method with the same drafter: per-round acceptances compared

    def __post_init__(self) -> None:
        if (self.build is None) == (self.speculative_config is None):
            raise ValueError("a Method is built in process (build) or by vLLM (speculative_config), not both")

    @property
    def in_vllm(self) -> bool:
        """Runs in the vLLM subprocess after ours, not in this process."""
        return self.speculative_config is not None
