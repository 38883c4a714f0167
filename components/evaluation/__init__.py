"""Evaluation: τ, acceptance by position, tokens/s and speedup of several decoding methods on the
same held-out prompts, in the same process, each checked against plain decoding.

* ``prompts``   -- the held-out prompts (the embedded target's held-out split, or a prompt file);
* ``methods``   -- what is compared: our plain decoding, our engine with the trained drafter and
  with prompt lookup, transformers' generate alone / with prompt lookup / with an assistant;
* ``hf``        -- the transformers wrappers and how their rounds are read off target passes;
* ``assistant`` -- the separate small LM for assisted generation (built for the embedded target);
* ``metrics``   -- per-prompt runs, τ, acceptance by position, speedups, token comparisons;
* ``runner``    -- warmup, interleaved timing, the lossless check with near-tie diagnosis;
* ``vllm_peers`` / ``vllm_run`` -- vLLM as a peer (opt-in ``vllm_*`` methods): this side plans
  and reads them, ``vllm_run`` runs them all in one subprocess of the vLLM environment;
* ``report``    -- markdown tables, flat metrics, plots.

Knows nothing about MLflow or Ray (``pipelines/evaluate.py`` logs); no training happens here
except the one-off pretraining of the embedded assistant.
"""

from components.evaluation.methods import HF_METHODS, METHODS, REFERENCE, EvalContext, check_methods
from components.evaluation.metrics import MethodSummary, Mismatch, PromptRun
from components.evaluation.prompts import eval_prompts
from components.evaluation.runner import EvalReport, evaluate

__all__ = [
    "HF_METHODS",
    "METHODS",
    "REFERENCE",
    "EvalContext",
    "EvalReport",
    "MethodSummary",
    "Mismatch",
    "PromptRun",
    "check_methods",
    "eval_prompts",
    "evaluate",
]
