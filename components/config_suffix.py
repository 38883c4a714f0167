"""The checks of suffix decoding's configuration keys (``suffix_*`` and
``hybrid_suffix_threshold``), which the eval and serve sections of ``components.config`` both
declare: what is out of range, each problem naming its key. Declares no keys itself and knows
nothing about the suffix tree or the engine.
"""

from __future__ import annotations

from typing import Any


def suffix_problems(section: Any) -> list[str]:
    """What is out of range in a section's suffix decoding keys (``suffix_*``,
    ``hybrid_suffix_threshold``: the eval and serve sections have them), each naming its key."""
    problems = []
    if not 1 <= section.suffix_num_speculative_tokens < section.suffix_max_tree_depth:
        problems.append(f"suffix_max_tree_depth must exceed suffix_num_speculative_tokens ≥ 1 (a match leaves room "
                        f"for a whole draft in the tree); got {section.suffix_max_tree_depth} and "
                        f"{section.suffix_num_speculative_tokens}")
    if section.suffix_max_spec_factor <= 0:
        problems.append(f"suffix_max_spec_factor must be > 0 (got {section.suffix_max_spec_factor})")
    if not 0 <= section.suffix_min_token_prob <= 1:
        problems.append(f"suffix_min_token_prob must be in [0, 1] (got {section.suffix_min_token_prob})")
    if section.suffix_max_cached_responses < 0:
        problems.append(f"suffix_max_cached_responses must be ≥ 0, 0 for no global tree "
                        f"(got {section.suffix_max_cached_responses})")
    threshold = section.hybrid_suffix_threshold
    if threshold is not None and not threshold >= 0:  # NaN too
        problems.append(f"hybrid_suffix_threshold must be ≥ 0 in suffix score units (Σ estimated probabilities), "
                        f".inf for never, null for γ (got {threshold})")
    return problems
