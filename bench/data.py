"""Benchmark of the data stage: rollout + hidden-state capture vs plain generate.

    python bench/data.py conf=dspark.yaml [data.max_prompts=32 data.max_new_tokens=32 ...] [--ray]

Same prompts, same run, same threads (``data.torch_threads``), greedy unless configured:

- ``hf_generate``: a plain transformers ``model.generate`` loop over the prompts in batches of
  ``data.batch_size`` (left-padded) — what a user would write without specline;
- ``data_stage[hf]``: specline's :class:`Roller` in process on the transformers forward (its own
  decoding loop with per-prompt seeds, then one forward that captures the drafter's layers +
  last layer, encoded to storage);
- ``data_stage[fast]``: the same on the fast target step (``target.step``; a continuous batch of
  ``data.batch_size`` rows over a static KV slab, hidden states captured in the same passes);
- ``data_stage[fast bf16]`` (``--bf16``) / ``[fast int8]`` (``--int8``) / ``[fast int16]``
  (``--int16``): the fast step with ``target.step_precision: bfloat16`` (its Q4_1 products on
  bfloat16 inputs; CPUs with AVX-512 BF16) / ``int8`` / ``int16`` (its block products on 8- or
  16-bit integer inputs; AVX-512 VNNI);
- ``--ray``: also the whole shards path under Ray Data (actor start-up, writes, manifest).

Prints tokens/s (generated tokens) of each, their ratio to hf_generate, the time spent capturing
hidden states, and how many records each fast path agrees on with the hf one, token for token. Nothing is
asserted about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import SpeclineConfig
from components.confload import load_cli
from components.data.prompts import Prompt, PromptStats, collect_prompts
from components.data.rollout import Roller, left_pad
from components.data.source import TargetDescription, describe_target, record_meta


@torch.no_grad()
def hf_generate(roller: Roller, prompts, batch_size: int, max_new: int, temperature: float) -> int:
    """Generated tokens of a plain ``model.generate`` loop (stop tokens count, padding not)."""
    model, target = roller.target.model, roller.target
    total = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        ids, mask = left_pad([p.input_ids for p in batch], roller.pad_id, target.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=temperature > 0, temperature=temperature or None, top_p=None,
                             top_k=None, eos_token_id=roller.stop_ids, pad_token_id=roller.pad_id)
        new = out[:, ids.shape[1]:]  # [B, N]
        for row in new.tolist():
            stop = next((k for k, t in enumerate(row) if t in roller.stop_ids), len(row) - 1)
            total += stop + 1
    return total


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ray", action="store_true", help="also time the shards path under Ray Data")
    ap.add_argument("--bf16", action="store_true", help="also the fast step with target.step_precision: bfloat16")
    ap.add_argument("--int8", action="store_true", help="also the fast step with target.step_precision: int8")
    ap.add_argument("--int16", action="store_true", help="also the fast step with target.step_precision: int16")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_cli(overrides)
    info = describe_target(cfg)
    prompts, stats = collect_prompts(cfg.data, info.tokenizer, info.corpus_dir)
    meta = record_meta(cfg, info)
    hf_cfg = dataclasses.replace(info.target_cfg, step="hf", step_precision="float32")
    rollers = {"data_stage[hf]": Roller(hf_cfg, cfg.data, meta)}
    fast = Roller(info.target_cfg, cfg.data, meta)
    if fast.decoder is not None:
        rollers["data_stage[fast]"] = fast
    else:
        print(f"data_stage[fast]: not run ({fast.why_not_fast})")
    for tag, precision in (("bf16", "bfloat16"), ("int8", "int8"), ("int16", "int16")):
        if getattr(args, tag):
            rollers[f"data_stage[fast {tag}]"] = Roller(dataclasses.replace(info.target_cfg, step_precision=precision),
                                                       cfg.data, meta)
    plain = rollers["data_stage[hf]"]
    warm = prompts[:min(2, len(prompts))]
    for roller in rollers.values():  # warm up every path
        roller(warm)
    hf_generate(plain, warm, cfg.data.batch_size, 4, cfg.data.temperature)

    print(f"target: {info.info.num_layers} layers, hidden {info.info.hidden_size}; {len(prompts)} prompts, "
          f"batch {cfg.data.batch_size}, max_new_tokens {cfg.data.max_new_tokens}, "
          f"threads {torch.get_num_threads()}, storage {cfg.data.storage}")
    t0 = time.perf_counter()
    hf_tokens = hf_generate(plain, prompts, cfg.data.batch_size, cfg.data.max_new_tokens, cfg.data.temperature)
    hf_s = time.perf_counter() - t0
    hf_tps = hf_tokens / hf_s
    print(f"hf_generate      : {hf_tokens:6d} tokens in {hf_s:7.2f} s = {hf_tps:8.1f} tok/s")
    outputs = {}
    for name, roller in rollers.items():
        roller.seconds = {"generate": 0.0, "capture": 0.0}
        t0 = time.perf_counter()
        outputs[name] = records = roller(prompts)
        took = time.perf_counter() - t0
        tokens = sum(int(r.loss_mask.sum()) for r in records)
        print(f"{name:17s}: {tokens:6d} tokens in {took:7.2f} s = {tokens / took:8.1f} tok/s "
              f"({tokens / took / hf_tps:.2f}x hf_generate; generate {roller.seconds['generate']:.2f} s, "
              f"capture {roller.seconds['capture']:.2f} s)")
    reference = outputs["data_stage[hf]"]
    for name, records in outputs.items():
        if name != "data_stage[hf]":
            same = sum(x.input_ids.tolist() == y.input_ids.tolist() for x, y in zip(records, reference))
            print(f"same tokens, {name} vs data_stage[hf]: {same} of {len(records)} records")
    if args.ray:
        time_ray_shards(cfg, info, prompts, stats)


def time_ray_shards(cfg: SpeclineConfig, info: TargetDescription, prompts: list[Prompt], stats: PromptStats) -> None:
    """The data stage's own shards path under Ray Data, into a temporary directory, timed whole."""
    from components.cluster import init_ray
    from components.data.build import build_shards

    init_ray(cfg.ray)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m = build_shards(cfg, info, prompts, stats, Path(tmp))
        ray_s = time.perf_counter() - t0
    rt = m["totals"]["response_tokens"]
    print(f"ray_shards  : {rt:6d} tokens in {ray_s:7.2f} s = {rt / ray_s:8.1f} tok/s (actor start-up and "
          f"writes included; {m['totals']['bytes_per_token']:.0f} bytes/token on disk)")


if __name__ == "__main__":
    main(sys.argv[1:])
