"""Token trees in the engine (batch 1): draft a tree, verify every branch in one target pass,
keep the accepted path. For small batches, where a wider verification pass is nearly free.

One round, for committed x_0..x_{n-1} (the invariant of ``engine.py``)::

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

The output is the target's own under each rule (tests: greedy and Gumbel token for token,
sampling by a chi-square test). Not combined with DLoop stages or carryover; rules without
``trees`` (block) are for chains only. The prefill and the loop are the chain engine's
(``engine.py``); the causal builder needs a drafter declaring ``Capability.CAUSAL_TREE_HEAD``
(refused at build time otherwise). Knows the engine protocol of drafters and the tree builders of ``components.spec``;
nothing about drafter families or which rule verifies how.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING
from components.drafters.capabilities import Capability, require
from components.engine.cache.ragged import keep_slots
from components.engine.engine import (
    EngineDrafter,
    GenerationResult,
    SequenceState,
    SpeculativeEngine,
    decode,
    sync_device,
)
from components.engine.rules import RoundRandomness, get_rule
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
    """Rounds with a DDTree of up to ``budget`` nodes in place of a chain; the prefill is that of
    a ``SpeculativeEngine`` of the same rule (``chain``)."""

    def __init__(self, target: Any, drafter: EngineDrafter, rule: str = "greedy", num_speculative_tokens: int | None = None,
                 budget: int = 16, builder: str = "ddtree", top_m: int = 8, preallocate: bool = True):
        """``builder``: ``ddtree`` (per-depth marginals) or ``causal`` (DominoTree: children scored
        on their own path by the drafter's ``causal_tree_head``, among the top-``top_m`` tokens)."""
        if not get_rule(rule).trees:
            raise ValueError(f"tree engine: rule '{rule}' verifies chains only (tree rules: {rules_where(trees=True)})")
        if budget < 1:
            raise ValueError(f"tree engine: budget must be >= 1 node, got {budget}")
        if builder not in ("ddtree", "causal"):
            raise ValueError(f"tree engine: builder '{builder}' is not 'ddtree' or 'causal'")
        if builder == "causal":
            require(drafter, "tree engine builder 'causal'", Capability.CAUSAL_TREE_HEAD,
                    hint="e.g. DSpark with markov_head linear/rnn has it; else use builder 'ddtree'")
        self.chain = SpeculativeEngine(target, drafter, rule, num_speculative_tokens, preallocate=preallocate)
        self.target, self.drafter, self.rule = target, drafter, self.chain.rule
        self.num_speculative_tokens, self.layer_ids = self.chain.num_speculative_tokens, self.chain.layer_ids
        self.budget, self.builder, self.top_m = int(budget), builder, int(top_m)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = DEFAULT_SAMPLING,
                 seed: int = 0) -> GenerationResult:
        """Exactly ``max_new_tokens`` new token ids after ``prompt_ids`` (lossless under the rule)."""
        return decode(self, prompt_ids, max_new_tokens, sampling, seed)

    def prefill(self, prompt: Tensor, rnd: RoundRandomness) -> SequenceState:
        """prompt [1, P] → the sequence after the first new token (``SpeculativeEngine.prefill``)."""
        return self.chain.prefill(prompt, rnd)

    def draft_tree(self, seq: SequenceState, depth: int, rnd: RoundRandomness) -> TokenTree:
        """The DDTree of the drafter's γ-slot distributions (≤ ``budget`` nodes, depth ≤ ``depth``)."""
        prop = self.drafter.propose(seq.draft_state, seq.last_token, self.rule.draft_sampling(rnd), rnd.generator,
                                    num_speculative_tokens=depth)
        shaping = rnd.sampling if rnd.sampling.temperature > 0 else SamplingParams()  # greedy: raw softmax
        log_q = log_probs_from_logits(prop.logits[0].float(), shaping)  # [γ, V]
        if self.builder == "causal" and prop.states is not None:
            head = self.drafter.causal_tree_head(prop.states[0])
            return build_causal_trees(log_q[None], seq.last_token, head, self.budget, self.top_m)[0]
        return build_best_first_tree(log_q, self.budget)

    def verify_tree(self, seq: SequenceState, tree: TokenTree,
                    rnd: RoundRandomness) -> tuple[TreeVerifyResult, Tensor | None, Any]:
        """One target forward over [x_{n-1}, nodes] → (walk result, hidden [1, N+1, n, H], cache)."""
        dev, past = seq.last_token.device, seq.length - 1
        ids = torch.cat([seq.last_token, tree.tokens.to(dev)])[None]  # [1, N+1]
        depths = tree.depths.to(dev)[None]  # [1, N]
        positions = past + torch.cat([torch.zeros_like(depths[:, :1]), depths], dim=1)  # [1, N+1]
        mask = _tree_mask(tree.parents.to(dev), past, self.target.dtype)
        out = self.target.forward(ids, attention_mask=mask, layer_ids=self.layer_ids, cache=seq.cache,
                                  use_cache=True, position_ids=positions)
        tokens, parents = tree.tokens.to(dev)[None], tree.parents.to(dev)[None]
        result = self.rule.verify_tree(tokens, parents, depths, out.logits, seq.length, rnd)
        return result, out.hidden, out.cache

    def accept_tree(self, seq: SequenceState, tree: TokenTree, result: TreeVerifyResult, hidden: Tensor | None,
                    cache: Any) -> SequenceState:
        """Keep the root and the accepted path in the cache; the drafter consumes them."""
        a = int(result.num_accepted[0])
        path = result.path[0, :a]  # accepted node indices, by depth
        kept = torch.cat([torch.zeros(1, dtype=torch.long, device=path.device), path + 1])  # slots after past
        keep_slots(cache, seq.length - 1, kept)
        path_tokens = tree.tokens.to(path.device)[path]
        tokens = torch.cat([seq.last_token, path_tokens])[None]  # [1, a+1]
        kept_hidden = hidden[:, kept] if hidden is not None else None
        state = self.drafter.consume(seq.draft_state, tokens, kept_hidden)
        emitted = path_tokens.tolist() + [int(result.next_token[0])]
        return SequenceState(cache, state, result.next_token, seq.length + a + 1, seq.new_tokens + emitted)

    def round(self, seq: SequenceState, remaining: int, rnd: RoundRandomness, res: GenerationResult) -> SequenceState:
        """One draft-verify-accept round with a tree, timed into ``res``."""
        dev = seq.last_token.device
        depth = max(1, min(self.num_speculative_tokens, remaining - 1))
        t0 = time.perf_counter()
        tree = self.draft_tree(seq, depth, rnd)
        sync_device(dev)
        t1 = time.perf_counter()
        result, hidden, cache = self.verify_tree(seq, tree, rnd)
        seq = self.accept_tree(seq, tree, result, hidden, cache)
        sync_device(dev)
        res.draft_seconds += t1 - t0
        res.verify_seconds += time.perf_counter() - t1
        res.add_round(int(result.num_accepted[0]), int(tree.tokens.numel()))
        return seq


def _tree_mask(parents: Tensor, past: int, dtype: torch.dtype) -> Tensor:  # → [1, 1, N+1, past+N+1]
    """Additive mask: every slot sees the context and the root; node j its ancestors and itself."""
    n = parents.shape[0]
    allowed = torch.zeros(n + 1, past + n + 1, dtype=torch.bool, device=parents.device)
    allowed[:, :past + 1] = True  # context + root
    allowed[1:, past + 1:] = ancestor_mask(parents)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=parents.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
