"""How the engines draft, resolved once: ``EngineSettings`` and ``resolve_settings``.

The batch-1 chain engine, the tree engine, the batch engine and the adaptive cap's set-up and
profiles all take one ``EngineSettings``; nothing reads a setting back from an engine it built.
``resolve_settings`` fills in the drafter's default γ and checks, once, what the settings need
of the drafter (declared capabilities, ``components.drafters.capabilities``). Every default
(the DLoop gate, the tree builder) is written here only.

Knows the drafter's declared capabilities and its γ; nothing about rules, models or caches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from components.drafters.capabilities import Capability, has, require

DEFAULT_LOOP_GATE = -0.5  # DLoop: another stage while Σ log q(stage drafts) ≥ this
OPEN_GATE = float("-inf")  # every stage allowed: under the adaptive cap, the cap decides
TREE_BUILDERS = ("ddtree", "causal")


@dataclass(frozen=True)
class EngineSettings:
    """The drafting settings of an engine, for one drafter (``resolve_settings``)."""

    num_speculative_tokens: int = 0  # γ: drafts per block, the configured value (0: no drafter)
    loop_stages: int = 1  # DLoop: blocks per round at most (1: off)
    loop_gate: float = DEFAULT_LOOP_GATE  # DLoop: another block while Σ log q(block) ≥ this
    carryover: bool = False  # the rejected drafts' target states become the next round's context
    tree_budget: int = 0  # > 0: token trees of this many nodes (batch engine: for a lone row)
    tree_builder: str = "ddtree"  # ddtree (per-depth marginals) | causal (the drafter's causal head)
    tree_top_m: int = 8  # causal builder: children scored among each depth's top-M tokens
    preallocate: bool = True  # the KV cache grows in place in a buffer with headroom (``cache.slab``)

    @property
    def max_cap(self) -> int:
        """The most drafts a round may verify: γ per DLoop stage."""
        return self.num_speculative_tokens * self.loop_stages

    def describe(self) -> dict[str, str]:
        """Every setting as text (what stored round profiles are keyed by)."""
        return {f.name: repr(getattr(self, f.name)) for f in fields(self)}


def resolve_settings(drafter: Any, num_speculative_tokens: int | None = None,
                     loop_stages: int = EngineSettings.loop_stages, loop_gate: float = EngineSettings.loop_gate,
                     carryover: bool = EngineSettings.carryover, preallocate: bool = EngineSettings.preallocate,
                     tree_budget: int = EngineSettings.tree_budget, tree_builder: str = EngineSettings.tree_builder,
                     tree_top_m: int = EngineSettings.tree_top_m) -> EngineSettings:
    """The settings for ``drafter`` (None: plain decoding), γ defaulting to the drafter's own and
    every other option to ``EngineSettings``'s; raises ValueError (or ``CapabilityError``) for a
    combination the drafter cannot serve."""
    if drafter is None:
        if tree_budget > 0:
            raise ValueError("tree_budget: token trees need a drafter")
        return EngineSettings(loop_gate=float(loop_gate), tree_builder=tree_builder, preallocate=bool(preallocate))
    gamma = int(num_speculative_tokens or drafter.num_speculative_tokens)
    _check_gamma(drafter, gamma)
    _check_loop(drafter, int(loop_stages), bool(carryover))
    _check_tree(drafter, int(tree_budget), tree_builder, int(loop_stages), bool(carryover))
    return EngineSettings(gamma, int(loop_stages), float(loop_gate), bool(carryover), int(tree_budget), tree_builder,
                          int(tree_top_m), bool(preallocate))


def _check_gamma(drafter: Any, gamma: int) -> None:
    """The engine's γ may differ from the drafter's configured one (which the registry checked
    when it built the drafter): a drafter declaring ``ROUND_LIMIT`` drafts at most
    ``max_speculative_tokens`` a round (a block drafter one block per stage, P-EAGLE the depths it
    was trained for)."""
    if has(drafter, Capability.ROUND_LIMIT) and gamma > drafter.max_speculative_tokens:
        per = "per block (DLoop stages add blocks: loop_stages)" if has(drafter, Capability.BLOCK_INTERNALS) else "a round"
        raise ValueError(f"num_speculative_tokens={gamma}: drafter '{drafter.cfg.name}' drafts "
                         f"at most {drafter.max_speculative_tokens} {per}")


def _check_loop(drafter: Any, loop_stages: int, carryover: bool) -> None:
    if loop_stages < 1:
        raise ValueError(f"loop_stages must be >= 1, got {loop_stages}")
    if loop_stages > 1:
        require(drafter, f"engine loop_stages={loop_stages} (DLoop)", Capability.OWN_CONTEXT,
                hint="a block drafter (dflash, dspark) drafts on its own states")
    if carryover:
        require(drafter, "engine carryover=True", Capability.CARRYOVER,
                hint="a block drafter (dflash, dspark) built with drafter.carryover=true has it")


def _check_tree(drafter: Any, budget: int, builder: str, loop_stages: int, carryover: bool) -> None:
    if budget <= 0:
        return
    if builder not in TREE_BUILDERS:
        raise ValueError(f"tree engine: builder '{builder}' is not one of {list(TREE_BUILDERS)}")
    if loop_stages > 1 or carryover:
        raise ValueError("tree_budget: token trees are not combined with DLoop stages or carryover")
    if builder == "causal":
        require(drafter, "tree engine builder 'causal'", Capability.CAUSAL_TREE_HEAD,
                hint="e.g. DSpark with markov_head linear/rnn has it; else use builder 'ddtree'")
