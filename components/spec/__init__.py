"""The verifier's side of speculative decoding, as pure batched PyTorch.

* ``sampling``     -- temperature / top-k / top-p, applied alike to target and drafter logits;
* ``verify``       -- chain rules: greedy, Gumbel coupling, speculative sampling, block verification;
* ``gumbel``       -- position-keyed shared Gumbel noise (drafter-invariant sampling);
* ``trees``        -- token trees: DDTree / DominoTree-style best-first builders, flattening, masks;
* ``tree_verify``  -- tree rules: greedy, Gumbel, lossless sampling (recursive rejection);
* ``cost``         -- acceptance length, speedup formulas, KV bytes (the draft-length policy is
  the engine's ``schedule``);
* ``reference``    -- plain-Python loops that the fast paths are tested against.

Knows nothing about models, KV caches, Ray or tokenizers: tensors of ids and distributions in,
decisions out.
"""

from components.spec.sampling import (
    GREEDY,
    SamplingParams,
    log_probs_from_logits,
    probs_from_logits,
)
from components.spec.tree_verify import (
    TreeVerifyResult,
    verify_tree_greedy,
    verify_tree_gumbel,
    verify_tree_sampling,
)
from components.spec.trees import (
    FlatTree,
    TokenTree,
    build_best_first_tree,
    build_causal_trees,
    flatten_trees,
)
from components.spec.verify import (
    VerifyResult,
    emitted_tokens,
    verify_block,
    verify_greedy,
    verify_gumbel,
    verify_speculative,
)

__all__ = [
    "GREEDY",
    "FlatTree",
    "SamplingParams",
    "TokenTree",
    "TreeVerifyResult",
    "VerifyResult",
    "build_best_first_tree",
    "build_causal_trees",
    "emitted_tokens",
    "flatten_trees",
    "log_probs_from_logits",
    "probs_from_logits",
    "verify_block",
    "verify_greedy",
    "verify_gumbel",
    "verify_speculative",
    "verify_tree_greedy",
    "verify_tree_gumbel",
    "verify_tree_sampling",
]
