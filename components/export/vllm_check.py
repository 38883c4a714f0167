"""Does vLLM load a drafter export, consume every weight, and decode losslessly? (run in .venv-vllm)

    python -m components.export.vllm_check --target DIR \\
        --drafter-export DIR --method eagle3 --num-speculative-tokens 3 \\
        [--drafter-export DIR2 --method dflash --num-speculative-tokens 6 ...]

Runs the target alone once (greedy, a few prompts), then the target with each export under
``speculative_config``, and prints one JSON object: per export the load error (if any), whether
the greedy outputs equal the target-only ones, vLLM's acceptance counters, and the weight check.

"Every weight consumed" (``weights``): the export's safetensors and the drafter module vLLM built
are compared *by value* after vLLM loaded it, so renames, stacking (q/k/v → qkv_proj, gate/up →
gate_up_proj) and silent drops are all seen:

* ``unused``: export tensors found in no drafter parameter (each tensor must equal a parameter or
  a dim-0 slice of one) — what vLLM's loader dropped or routed elsewhere;
* ``uninitialized``: drafter parameters not entirely covered by export tensors and not shared
  with the target model (same storage as a target parameter) — what vLLM left at its init;
  ``model.mask_embedding`` (a placeholder DFlash/DSpark only fill from a ``mask_embedding.pt``
  file) is reported apart, in ``placeholders``.

The value match is unambiguous only if tensors differ from each other: the tests perturb every
weight of their random drafters (norms are all ones at init). Tensors vLLM drops by design and
that carry no information are listed in ``ignored_by_design`` (e.g. ``t2d``: vLLM maps the draft
vocabulary with ``d2t`` only).

DSpark cannot run on vLLM's CPU (V1) model runner ("Model Runner V1 does not support: dspark
speculative decoding"). For it the script records that refusal, then builds vLLM's config with
the V1 check skipped (which proves the export parses) and loads the drafter alone with vLLM's own
model loader, so the weight check runs the same way (embedding and LM head are shared from the
target only in a real run: ``shared_with_target`` lists what is absent for that reason).

vLLM spawns processes: everything runs under ``if __name__ == "__main__"``. The engine core runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the check can read the drafter's weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PROMPTS = ["def main(args):\n", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self", "# Copyright"]
IGNORED_BY_DESIGN = {"t2d"}  # vLLM maps draft ids with d2t alone
PLACEHOLDERS = {"model.mask_embedding"}
SHARED_FROM_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}
REFUSED_ON_CPU = {"dspark": "Model Runner V1 does not support: dspark speculative decoding"}


# ----------------------------------------------------------------------------- weight check
def _find(t, params: dict[str, Any], covered: dict[str, Any]) -> tuple[str, int] | None:
    """(param name, dim-0 offset) of a parameter of the same kind (float or integer) whose rows
    [off, off+len(t)) equal t; a match on rows not covered yet wins (identical tensors, e.g.
    Medusa's LM-head copies, go one per param)."""
    import torch

    hits = []
    for name, p in params.items():
        if p.dim() != t.dim() or p.shape[1:] != t.shape[1:] or (p.dim() and p.shape[0] < t.shape[0]):
            continue
        if p.dtype.is_floating_point != t.dtype.is_floating_point:  # a float cast to an int id map could "match"
            continue
        tt = t.to(device=p.device, dtype=p.dtype)
        if t.dim() == 0:
            if torch.equal(p, tt):
                hits.append((name, 0))
            continue
        rows = p.reshape(p.shape[0], -1)
        for off in torch.nonzero((rows == tt[0].reshape(-1)).all(dim=1)).flatten().tolist():
            if off + t.shape[0] <= p.shape[0] and torch.equal(p[off:off + t.shape[0]], tt):
                hits.append((name, off))
    n = t.shape[0] if t.dim() else 1
    for name, off in hits:
        if not bool(covered[name][off:off + n].any()):
            return name, off
    return hits[0] if hits else None


def weight_report(model: Any, export_dir: str, target_model: Any | None) -> dict[str, Any]:
    """Compares the export's tensors with the loaded drafter ``model`` (see the module doc).

    Values are those the loader wrote (snapshot taken before vLLM's post-load processing, which
    may repack CPU linear weights); sharing with the target is judged on the final parameters."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(export_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    final = dict(model.named_parameters(remove_duplicate=False))
    params = getattr(model, "_specline_loaded", None) or final
    target_ptrs = set()
    if target_model is not None:
        target_ptrs = {p.untyped_storage().data_ptr() for p in target_model.parameters()}
    covered = {name: torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.bool) for name, p in params.items()}
    unused, ignored, placed = [], [], {}
    for key, t in sorted(tensors.items()):
        if key in IGNORED_BY_DESIGN:
            ignored.append(key)
            continue
        hit = _find(t, params, covered)
        if hit is None:
            unused.append(key)
            continue
        name, off = hit
        placed[key] = f"{name}[{off}:{off + (t.shape[0] if t.dim() else 1)}]"
        covered[name][off:off + (t.shape[0] if t.dim() else 1)] = True
    uninitialized, shared, placeholders = [], [], []
    for name in params:
        if bool(covered[name].all()):
            continue
        if name in final and final[name].untyped_storage().data_ptr() in target_ptrs:
            shared.append(name)
        elif name in PLACEHOLDERS:
            placeholders.append(name)
        elif target_model is None and name in SHARED_FROM_TARGET:
            shared.append(name)
        else:
            uninitialized.append(f"{name} ({int(covered[name].sum())}/{covered[name].numel()} rows)")
    return {"export_tensors": len(tensors), "placed": placed, "unused": unused,
            "ignored_by_design": ignored, "uninitialized": uninitialized,
            "shared_with_target": sorted(shared), "placeholders": placeholders,
            "ok": not unused and not uninitialized}


# Buffers vLLM's loaders fill from a checkpoint (P-EAGLE's mask_hidden): checked as parameters are
LOADED_BUFFERS = ("mask_hidden",)


def snapshot_loaded_weights() -> None:
    """Makes vLLM's loader keep a copy of every model's parameters as loaded (before repacking)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "_specline", False):
        return

    def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
        model._specline_loaded = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        model._specline_loaded.update({n: b.detach().clone() for n, b in model.named_buffers()
                                       if n.rsplit(".", 1)[-1] in LOADED_BUFFERS})
        return original(model, *args, **kwargs)

    wrapped._specline = True
    base_loader.process_weights_after_loading = wrapped


def _worker_report(worker: Any, export_dir: str) -> dict[str, Any]:
    runner = worker.model_runner
    return weight_report(runner.drafter.model, export_dir, runner.model)


# ----------------------------------------------------------------------------- runs
def _llm(target: str, spec: dict[str, Any] | None, args: argparse.Namespace):
    from vllm import LLM

    return LLM(model=target, tokenizer=target, dtype="float32", seed=0, max_model_len=args.max_model_len,
               enforce_eager=True, disable_log_stats=False, speculative_config=spec,
               max_num_seqs=len(PROMPTS), gpu_memory_utilization=0.5)


def _generate(llm: Any, args: argparse.Namespace) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            key = m.name.removeprefix("vllm:spec_decode_")
            out[key] = list(getattr(m, "values", [])) or getattr(m, "value", None)
    drafts, accepted = out.get("num_drafts"), out.get("num_accepted_tokens")
    if drafts:
        out["mean_acceptance_length"] = 1 + accepted / drafts
    return out


def _release(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001  (best effort: the next LLM() must still start)
        print(f"vllm_check: engine shutdown: {exc}", file=sys.stderr)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _load_only(target: str, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Parses the export with vLLM's config (V1-runner refusal skipped) and loads it alone."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    original = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        cfg = EngineArgs(model=target, dtype="float32", seed=0, max_model_len=args.max_model_len,
                         enforce_eager=True, speculative_config=spec).create_engine_config()
    finally:
        VllmConfig._validate_v1_model_runner = original
    draft = cfg.speculative_config.draft_model_config
    parsed = {"method": cfg.speculative_config.method, "architectures": list(draft.architectures),
              "num_speculative_tokens": cfg.speculative_config.num_speculative_tokens}
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    parsed["aux_layer_ids"] = list(get_eagle3_aux_layers_from_config(cfg.speculative_config) or [])
    hf = draft.hf_config
    for key in ("target_layer_ids", "eagle_aux_hidden_state_layer_ids", "mask_token_id", "markov_rank",
                "block_size", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if getattr(hf, key, None) is not None:
            parsed[key] = getattr(hf, key)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
        initialize_model_parallel(1, 1)
        try:
            model = get_model(vllm_config=cfg, model_config=draft)
            report = weight_report(model, spec["model"], None)
        finally:
            cleanup_dist_env_and_memory()
    return {"parsed": parsed, "weights": report}


def parallel_drafting(path: str) -> dict[str, Any]:
    """``parallel_drafting: true`` for a P-EAGLE export: what vLLM's speculators parser sets for
    ``speculators_model_type: peagle``, which an explicit ``method`` (eagle3) does not."""
    config = json.loads((Path(path) / "config.json").read_text())
    return {"parallel_drafting": True} if config.get("speculators_model_type") == "peagle" else {}


def check(args: argparse.Namespace) -> dict[str, Any]:
    snapshot_loaded_weights()
    result: dict[str, Any] = {"target": args.target, "prompts": PROMPTS, "max_tokens": args.max_tokens}
    t0 = time.time()
    llm = _llm(args.target, None, args)
    reference = _generate(llm, args)
    _release(llm)
    result["target_only_seconds"] = round(time.time() - t0, 1)
    result["reference"] = reference
    runs = []
    for i, (path, method) in enumerate(zip(args.drafter_export, args.method)):
        k = args.num_speculative_tokens[i] if i < len(args.num_speculative_tokens) else None
        spec = {"method": method, "model": path, "num_speculative_tokens": k, **parallel_drafting(path)}
        run: dict[str, Any] = dict(spec)
        t0 = time.time()
        try:
            llm = _llm(args.target, spec, args)
        except Exception as exc:  # noqa: BLE001  (the engine refused the export: recorded)
            run["load_error"] = f"{type(exc).__name__}: {exc}"
            if method in REFUSED_ON_CPU and REFUSED_ON_CPU[method] in str(exc):
                try:
                    run.update(_load_only(args.target, spec, args))
                except Exception as exc2:  # noqa: BLE001  (recorded in the report)
                    run["load_only_error"] = f"{type(exc2).__name__}: {exc2}"
                    run["traceback"] = traceback.format_exc(limit=6)
            runs.append(run | {"seconds": round(time.time() - t0, 1)})
            gc.collect()
            continue
        try:
            run["weights"] = llm.collective_rpc(_worker_report, args=(path,))[0]
            outputs = _generate(llm, args)
            run["outputs_equal"] = outputs == reference
            run["matching_prompts"] = sum(a == b for a, b in zip(outputs, reference))
            if outputs != reference:
                run["outputs"] = outputs
            run["acceptance"] = _counters(llm)
        except Exception as exc:  # noqa: BLE001  (recorded in the report)
            run["run_error"] = f"{type(exc).__name__}: {exc}"
            run["traceback"] = traceback.format_exc(limit=6)
        finally:
            _release(llm)
        runs.append(run | {"seconds": round(time.time() - t0, 1)})
    result["runs"] = runs
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--drafter-export", action="append", default=[], help="export directory (repeatable)")
    p.add_argument("--method", action="append", default=[], help="speculative_config.method, one per export")
    p.add_argument("--num-speculative-tokens", action="append", type=int, default=[],
                   help="one per export (default: the export's own)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if len(args.method) != len(args.drafter_export):
        p.error("give one --method per --drafter-export")
    result = check(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print("VLLM_CHECK_JSON " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
