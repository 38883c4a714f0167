"""Token trees in the engine (batch 1): draft a tree, verify every branch in one target pass,
keep the accepted path. For small batches, where a wider verification pass is nearly free.
A drafter that proposes nothing (prompt lookup without a match) makes the round a plain step,
the chain engine's (``chain.verify_chain``), with no tree pass.

One round, for committed x_0..x_{n-1} (the invariant of ``core.py``)::

    draft   -- the drafter proposes γ slots after x_{n-1}; their distributions are the per-depth
               marginals of a DDTree (``spec.trees.build_best_first_tree``): the ``budget``
               best paths by summed log-probability, depth ≤ γ; or (``builder="causal"``) a
               DominoTree whose children are scored on their own path by the drafter's causal
               head (DSpark's Markov head) among each depth's top-M tokens;
    verify  -- one target forward over [x_{n-1}, tree nodes] [1, N+1]: node j sits at position
               n-1+depth_j and attends to the context, the root and its own ancestors (a 4-D
               additive mask); slot 0's logits predict the root's children, slot j+1's node j's;
               the rule walks the tree (``Rule.verify_tree``): greedy, Gumbel (shared noise
               keyed by absolute position) or lossless sampling for a deterministic tree;
    accept  -- the root and the accepted path's slots are moved together in the KV cache
               (``cache.keep_slots``: a gather, nothing recomputed), the rest dropped; the
               drafter consumes the path's hidden states from the verify pass.

The steps are functions (``tree_round``), which ``TreeEngine`` runs for one request (the loop
``single.decode``) and the batch engine for its lone row (``batch/tree_round.py``). The output is the target's own under
each rule (tests: greedy and Gumbel token for token, sampling by a chi-square test). Not
combined with DLoop stages or carryover; rules without ``trees`` (block) are for chains only.
The prefill and the loop are the chain engine's (``chain.py``, ``single.py``); the causal
builder needs a drafter declaring ``Capability.CAUSAL_TREE_HEAD`` (refused when the settings
are resolved); a drafter declaring ``Capability.TARGET_KV`` reads the target cache's committed
context before the tree's pass (``core.attach_target_kv``). Knows the engine protocol of
drafters and the tree builders of ``components.spec``; nothing about drafter families or which
rule verifies how.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING
from components.engine.cache.ragged import keep_slots
from components.engine.chain import accept_chain, num_drafts_for, verify_chain
from components.engine.core import (
    EngineDrafter,
    GenerationResult,
    SequenceState,
    attach_target_kv,
    sync_device,
)
from components.engine.rules import RoundRandomness, Rule, get_rule
from components.engine.settings import EngineSettings, resolve_settings
from components.engine.single import decode
from components.ruleset import rules_where
from components.spec.sampling import SamplingParams, log_probs_from_logits
from components.spec.tree_verify import TreeVerifyResult
from components.spec.trees import (
    TokenTree,
    ancestor_mask,
    build_best_first_tree,
    build_causal_trees,
)


class TreeEngine:
    """Rounds with a DDTree of up to ``budget`` nodes in place of a chain; the prefill is the
    chain engine's (``chain.prefill``)."""

    def __init__(self, target: Any, drafter: EngineDrafter, rule: str = "greedy", num_speculative_tokens: int | None = None,
                 budget: int = 16, builder: str = EngineSettings.tree_builder, top_m: int = EngineSettings.tree_top_m,
                 preallocate: bool = EngineSettings.preallocate, settings: EngineSettings | None = None):
        """``builder``: ``ddtree`` (per-depth marginals) or ``causal`` (DominoTree: children scored
        on their own path by the drafter's ``causal_tree_head``, among the top-``top_m`` tokens).
        ``settings``: resolved already (its tree budget ≥ 1); else resolved here."""
        self.rule = get_rule(rule)
        if not self.rule.trees:
            raise ValueError(f"tree engine: rule '{rule}' verifies chains only (tree rules: {rules_where(trees=True)})")
        self.settings = settings or resolve_settings(drafter, num_speculative_tokens, preallocate=preallocate,
                                                     tree_budget=budget, tree_builder=builder, tree_top_m=top_m)
        if self.settings.tree_budget < 1:
            raise ValueError(f"tree engine: budget must be >= 1 node, got {self.settings.tree_budget}")
        self.target, self.drafter = target, drafter

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = DEFAULT_SAMPLING,
                 seed: int = 0) -> GenerationResult:
        """Exactly ``max_new_tokens`` new token ids after ``prompt_ids`` (lossless under the rule)."""
        return decode(self.target, self.drafter, self.settings, self.rule, tree_round, prompt_ids, max_new_tokens,
                      sampling, seed)


def tree_round(target: Any, drafter: EngineDrafter, settings: EngineSettings, rule: Rule, seq: SequenceState,
               remaining: int, rnd: RoundRandomness, res: GenerationResult) -> SequenceState:
    """One draft-verify-accept round with a tree, timed into ``res``."""
    dev = seq.last_token.device
    t0 = time.perf_counter()
    tree = draft_tree(drafter, settings, rule, seq, num_drafts_for(settings.num_speculative_tokens, remaining), rnd)
    sync_device(dev)
    t1 = time.perf_counter()
    if tree.tokens.numel() == 0:  # the drafter proposed nothing: the chain engine's plain step
        none = torch.zeros(1, 0, dtype=torch.long, device=dev)
        result, hidden, cache = verify_chain(target, drafter, rule, seq, None, none, rnd)
        seq = accept_chain(drafter, settings, seq, none, result, hidden, cache, res)  # counts a plain round
    else:
        result, hidden, cache = verify_tree(target, drafter, rule, seq, tree, rnd)
        seq = accept_tree(drafter, seq, tree, result, hidden, cache)
        res.add_round(int(result.num_accepted[0]), int(tree.tokens.numel()))
    sync_device(dev)
    res.draft_seconds += t1 - t0
    res.verify_seconds += time.perf_counter() - t1
    return seq


def draft_tree(drafter: EngineDrafter, settings: EngineSettings, rule: Rule, seq: SequenceState, num_drafts: int,
               rnd: RoundRandomness) -> TokenTree:
    """The tree over the drafter's distributions at ``num_drafts`` slots (its depth at most;
    ≤ ``settings.tree_budget`` nodes). A ``Capability.TARGET_KV`` drafter is first handed views
    of ``seq.cache`` (kept as ``seq.draft_state``, as ``chain.draft_chain`` does)."""
    seq.draft_state = attach_target_kv(drafter, seq.draft_state, seq.cache)
    prop = drafter.propose(seq.draft_state, seq.last_token, rule.draft_sampling(rnd), rnd.generator,
                           num_speculative_tokens=num_drafts)
    shaping = rnd.sampling if rnd.sampling.temperature > 0 else SamplingParams()  # greedy: raw softmax
    log_q = log_probs_from_logits(prop.logits[0].float(), shaping)  # [num_drafts, V]
    if settings.tree_builder == "causal" and prop.states is not None:
        head = drafter.causal_tree_head(prop.states[0])
        return build_causal_trees(log_q[None], seq.last_token, head, settings.tree_budget, settings.tree_top_m)[0]
    return build_best_first_tree(log_q, settings.tree_budget)


def verify_tree(target: Any, drafter: EngineDrafter, rule: Rule, seq: SequenceState, tree: TokenTree,
                rnd: RoundRandomness) -> tuple[TreeVerifyResult, Tensor | None, Any]:
    """One target forward over [x_{n-1}, nodes] → (walk result, hidden [1, N+1, n, H], cache)."""
    dev, past = seq.last_token.device, seq.length - 1
    ids = torch.cat([seq.last_token, tree.tokens.to(dev)])[None]  # [1, N+1]
    depths = tree.depths.to(dev)[None]  # [1, N]
    where = past + torch.cat([torch.zeros_like(depths[:, :1]), depths], dim=1)  # [1, N+1]
    mask = _tree_mask(tree.parents.to(dev), past, target.dtype)
    out = target.forward(ids, attention_mask=mask, layer_ids=list(drafter.layer_ids), cache=seq.cache,
                         use_cache=True, position_ids=where)
    tokens, parents = tree.tokens.to(dev)[None], tree.parents.to(dev)[None]
    return rule.verify_tree(tokens, parents, depths, out.logits, seq.length, rnd), out.hidden, out.cache


def accept_tree(drafter: EngineDrafter, seq: SequenceState, tree: TokenTree, result: TreeVerifyResult,
                hidden: Tensor | None, cache: Any) -> SequenceState:
    """Keep the root and the accepted path in the cache; the drafter consumes them."""
    a = int(result.num_accepted[0])
    path = result.path[0, :a]  # accepted node indices, by depth
    kept = torch.cat([torch.zeros(1, dtype=torch.long, device=path.device), path + 1])  # slots after past
    keep_slots(cache, seq.length - 1, kept)
    path_tokens = tree.tokens.to(path.device)[path]
    tokens = torch.cat([seq.last_token, path_tokens])[None]  # [1, a+1]
    kept_hidden = hidden[:, kept] if hidden is not None else None
    state = drafter.consume(seq.draft_state, tokens, kept_hidden)
    emitted = path_tokens.tolist() + [int(result.next_token[0])]
    return SequenceState(cache, state, result.next_token, seq.length + a + 1, seq.new_tokens + emitted)


def _tree_mask(parents: Tensor, past: int, dtype: torch.dtype) -> Tensor:  # → [1, 1, N+1, past+N+1]
    """Additive mask: every slot sees the context and the root; node j its ancestors and itself."""
    n = parents.shape[0]
    allowed = torch.zeros(n + 1, past + n + 1, dtype=torch.bool, device=parents.device)
    allowed[:, :past + 1] = True  # context + root
    allowed[1:, past + 1:] = ancestor_mask(parents)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=parents.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
