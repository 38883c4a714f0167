"""Evaluation: τ, acceptance by position, tokens/s and speedup of several decoding methods on the
same held-out prompts, in the same process, each checked against plain decoding.

* ``prompts``   -- the held-out prompts (the embedded target's held-out split, or a prompt file);
* ``context``   -- ``EvalContext`` (the loaded parts) and ``Method`` (one registry entry: how it
  is built, whose it is, what it needs), below both ``methods`` and ``vllm_peers``;
* ``methods``   -- what is compared, one registry ``METHODS``: our plain decoding, our engine
  with the trained drafter and with prompt lookup, transformers' generate alone / with prompt
  lookup / with an assistant, and (from ``vllm_peers``) vLLM's;
* ``hf``        -- the transformers wrappers and how their rounds are read off target passes;
* ``assistant`` -- the separate small LM for assisted generation (built for the embedded target);
* ``metrics``   -- per-prompt runs, τ, acceptance by position, speedups, token comparisons;
* ``runner``    -- ``compare_methods``: warmup, interleaved timing, the lossless check with
  near-tie diagnosis;
* ``vllm_peers`` / ``vllm_run`` -- vLLM as a peer (opt-in ``vllm_*`` methods): this side plans
  and reads them, ``vllm_run`` runs them all in one subprocess of the vLLM environment;
* ``report``    -- ``results.md``, tables, flat metrics, plots.

Knows nothing about MLflow or Ray (``pipelines/evaluate.py`` logs); no training happens here
except the one-off pretraining of the embedded assistant.
"""

from components.evaluation.context import EvalContext, Method
from components.evaluation.methods import (
    METHODS,
    REFERENCE,
    check_methods,
    needs_assistant,
    needs_drafter,
    needs_rollouts,
)
from components.evaluation.metrics import MethodSummary, Mismatch, PromptRun
from components.evaluation.prompts import eval_prompts
from components.evaluation.runner import EvalReport, compare_methods

__all__ = [
    "METHODS",
    "REFERENCE",
    "EvalContext",
    "EvalReport",
    "Method",
    "MethodSummary",
    "Mismatch",
    "PromptRun",
    "check_methods",
    "compare_methods",
    "eval_prompts",
    "needs_assistant",
    "needs_drafter",
    "needs_rollouts",
]
