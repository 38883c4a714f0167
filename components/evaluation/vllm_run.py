"""vLLM as an evaluation peer: every vLLM method of one eval run, in one process (run in .venv-vllm).

    python -m components.evaluation.vllm_run --spec spec.json --out results.json

The spec (written by ``components.evaluation.vllm_peers``) names the target directory, the
prompts as *token ids* (both sides decode the very same inputs, no tokenizer in between),
``max_new_tokens``, the thread count and the methods, each with its vLLM ``speculative_config``
(null: the target alone). Per method, one after the other: one ``LLM`` (float32, eager, greedy
unless the spec's temperature says otherwise, ``ignore_eos``), one untimed warmup request, then
the prompts **one request at a time** (batch 1, like our engine), each timed around
``llm.generate`` (wall time: vLLM's scheduling, input/output processing and every forward pass;
no detokenization), then the LLM is released before the next method starts.

Per prompt the result holds the new token ids, the seconds, and vLLM's own per-request
speculative-decoding record (``per_request_spec_decode_metrics="detailed"``): accepted and
proposed drafts of every verify step, in order. Per method also the aggregate
``vllm:spec_decode_*`` counters over the timed requests (``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos``) and vLLM's mean acceptance length
``1 + accepted / drafts`` (the bonus/recovered token counted once per step, as our τ).

A method vLLM refuses (an export its CPU runner does not run, a missing optional package)
is recorded with the error and skipped; the others still run. n-gram methods run last: vLLM's
n-gram proposer imports numba, after which vLLM 0.32's CPU platform cannot start another engine
in the same process (its Triton-override scan trips over llvmlite's ``_lib_fn_wrapper``:
"AttributeError: '_lib_fn_wrapper' object has no attribute 'get'"). Knows vLLM's offline API and
``components.export.vllm_check``'s helpers; nothing about our engine, MLflow or reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from components.export.vllm_check import REFUSED_ON_CPU, _counters, _release

RESULT_PREFIX = "VLLM_EVAL_JSON "
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def make_llm(spec: dict[str, Any], speculative_config: dict[str, Any] | None) -> Any:
    """One vLLM engine on the spec's target, sized for one request at a time."""
    from vllm import LLM

    return LLM(model=spec["target"], tokenizer=spec["target"], dtype="float32", seed=spec.get("seed", 0),
               max_model_len=spec["max_model_len"], enforce_eager=True, disable_log_stats=False,
               speculative_config=speculative_config, max_num_seqs=1, gpu_memory_utilization=0.5,
               per_request_spec_decode_metrics="detailed" if speculative_config else "none")


def sampling(spec: dict[str, Any], max_tokens: int, seed: int) -> Any:
    from vllm import SamplingParams

    temperature = float(spec.get("temperature", 0.0))
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          seed=seed if temperature > 0 else None)


def one_request(llm: Any, ids: list[int], params: Any) -> tuple[list[int], float, Any]:
    """(new token ids, wall seconds, vLLM's per-request spec-decode metrics or None)."""
    clock = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
    seconds = time.perf_counter() - clock
    completion = out[0].outputs[0]
    return list(completion.token_ids), seconds, completion.spec_decode_metrics


def error_text(exc: BaseException) -> str:
    """One line: the type and every line of the message (pydantic puts the reason on line 2+)."""
    lines = [re.sub(r"\s*\[type=.*$", "", x.strip()) for x in str(exc).splitlines()
             if x.strip() and "errors.pydantic.dev" not in x]
    return f"{type(exc).__name__}: {' / '.join(lines)}"[:600]


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters accumulated between two ``_counters`` readings (per position as a list)."""
    out: dict[str, Any] = {}
    for key in COUNTERS:
        out[key] = int((after.get(key) or 0) - (before.get(key) or 0))
    pos_after = after.get("num_accepted_tokens_per_pos") or []
    pos_before = before.get("num_accepted_tokens_per_pos") or [0] * len(pos_after)
    if isinstance(pos_after, list):
        out["num_accepted_tokens_per_pos"] = [int(a - b) for a, b in zip(pos_after, pos_before)]
    if out["num_drafts"]:
        out["mean_acceptance_length"] = 1 + out["num_accepted_tokens"] / out["num_drafts"]
    return out


def run_method(spec: dict[str, Any], method: dict[str, Any]) -> dict[str, Any]:
    """Starts vLLM for one method, warms it up, runs every prompt once; releases it."""
    sc = method.get("speculative_config")
    result: dict[str, Any] = {"speculative_config": sc}
    clock = time.perf_counter()
    try:
        llm = make_llm(spec, sc)
    except Exception as exc:  # noqa: BLE001  (vLLM refused this method: recorded, the others run)
        refused = REFUSED_ON_CPU.get((sc or {}).get("method", ""))
        result["error"] = error_text(exc)
        result["refused_on_cpu"] = bool(refused and refused in str(exc))
        result["traceback"] = traceback.format_exc(limit=-6)
        return result
    result["startup_seconds"] = time.perf_counter() - clock
    try:
        prompts, n = spec["prompts"], spec["max_new_tokens"]
        if spec.get("warmup_tokens"):
            one_request(llm, prompts[0]["input_ids"], sampling(spec, spec["warmup_tokens"], prompts[0]["seed"]))
        before = _counters(llm) if sc else {}
        runs = []
        for p in prompts:
            tokens, seconds, metrics = one_request(llm, p["input_ids"], sampling(spec, n, p["seed"]))
            run = {"prompt_id": p["prompt_id"], "tokens": tokens, "seconds": seconds}
            if metrics is not None:
                run["accepted"] = list(metrics.per_step_accepted)
                run["drafted"] = list(metrics.per_step_drafted)
            runs.append(run)
        result["runs"] = runs
        if sc:
            result["counters"] = _delta(before, _counters(llm))
    except Exception as exc:  # noqa: BLE001  (recorded; the next method still runs)
        result["error"] = error_text(exc)
        result["traceback"] = traceback.format_exc(limit=-6)
    finally:
        _release(llm)
    return result


def _uses_numba(method: dict[str, Any]) -> bool:
    return (method.get("speculative_config") or {}).get("method") == "ngram"


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm

    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    out: dict[str, Any] = {"vllm_version": vllm.__version__, "threads": torch.get_num_threads(), "methods": {}}
    for method in sorted(spec["methods"], key=_uses_numba):  # stable: n-gram methods last (see above)
        out["methods"][method["name"]] = run_method(spec, method)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="JSON spec (see the module doc)")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args(argv)
    result = run_spec(json.loads(Path(args.spec).read_text()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # threads as the spec says
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
