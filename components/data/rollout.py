"""Rollouts: the target regenerates each prompt's response, then its hidden states are captured.

Two steps per batch of prompts, both on the target:

1. ``generate``: batched decoding (left-padded prompts, KV cache) with greedy or temperature /
   top-p sampling, one ``torch.Generator`` per prompt seeded from its id, so a prompt's
   response does not depend on which batch or actor it landed in. The transformers backend
   runs anywhere; the vLLM backend (GPU clusters) is imported only when configured.
2. ``capture``: one forward over prompt + response (right-padded) that keeps the outputs of
   the drafter's layers and the pre-norm last layer, encoded to the storage dtype.

:class:`Roller` is constructed once per Ray Data actor (it loads the target). It knows the
target and records; it knows nothing about shards, manifests or MLflow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from components.config import DataConfig, TargetConfig
from components.data.emit import sample_next, to_record
from components.data.prompts import Prompt
from components.data.records import Record, RecordMeta
from components.data.slab_rollout import slab_rollouts


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """→ (ids [B, P], attention mask [B, P]) with padding on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[b, width - len(s):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(target: Any, prompts: Sequence[Prompt], cfg: DataConfig, stop_ids: Sequence[int],
             pad_id: int) -> list[list[int]]:
    """Responses (stop token included) of ``target`` to ``prompts``, decoded in one batch."""
    device = target.device
    ids, mask = left_pad([p.input_ids for p in prompts], pad_id, device)  # [B, P]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    gens = [torch.Generator(device=device).manual_seed(p.seed) for p in prompts]
    out = target.forward(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    stop = torch.tensor(list(stop_ids), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    responses: list[list[int]] = [[] for _ in prompts]
    next_pos = positions[:, -1:] + 1  # [B, 1]
    for step in range(cfg.max_new_tokens):
        tok = sample_next(out.logits[:, -1], cfg.temperature, cfg.top_p, gens)  # [B]
        for b in (~done).nonzero().flatten().tolist():
            responses[b].append(int(tok[b]))
        done |= torch.isin(tok, stop)
        if bool(done.all()) or step == cfg.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = target.forward(tok[:, None], attention_mask=mask, position_ids=next_pos,
                             cache=out.cache, use_cache=True)
        next_pos = next_pos + 1
    return responses


@torch.no_grad()
def capture(target: Any, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]],
            meta: RecordMeta, pad_id: int) -> list[Record]:
    """One right-padded forward over prompt + response → encoded records."""
    seqs = [list(p.input_ids) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
    out = target.forward(ids.to(target.device), attention_mask=mask.to(target.device),
                         layer_ids=list(meta.layer_ids))
    hidden = out.hidden.float().cpu().numpy()  # [B, T, n, H]
    last = out.last_hidden.float().cpu().numpy()  # [B, T, H]
    return [to_record(p, seq, hidden[b], last[b], meta) for b, (p, seq) in enumerate(zip(prompts, seqs))]


class VllmGenerator:
    """Responses from vLLM's offline ``LLM`` (GPU clusters). Imported lazily; untested on CPU here."""

    def __init__(self, model_path: str, cfg: DataConfig):
        from vllm import LLM  # optional extra: pip install -e .[vllm]

        self.cfg = cfg
        # leaves room on the same GPU for the transformers copy that captures hidden states
        self.llm = LLM(model=model_path, seed=cfg.seed, enable_prefix_caching=True, gpu_memory_utilization=0.5)

    def __call__(self, prompts: Sequence[Prompt], stop_ids: Sequence[int]) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p, seed=p.seed,
                                 max_tokens=self.cfg.max_new_tokens, stop_token_ids=list(stop_ids))
                  for p in prompts]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p.input_ids)) for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]


class Roller:
    """Target (+ optional vLLM) held by one actor: prompts → records, with timings. With the
    transformers backend, where ``target.step`` chooses the fast step, the rollouts run on it
    (``slab_rollout``: a continuous batch of ``data.batch_size`` rows, hidden states captured as
    they are computed); else ``generate`` then ``capture``."""

    def __init__(self, target_cfg: TargetConfig, data_cfg: DataConfig, meta: RecordMeta):
        from components.target import load_target
        from components.target.fast import kernel_gemm, wanted_kernel
        from components.target.step import StaticDecoder
        from components.target.tokenizer import stop_token_ids

        if data_cfg.torch_threads > 0:
            torch.set_num_threads(data_cfg.torch_threads)
        self.cfg, self.meta = data_cfg, meta
        self.target = load_target(target_cfg, progress=False)
        self.decoder: StaticDecoder | None = None
        kernel, self.why_not_fast = wanted_kernel(self.target, target_cfg)
        if data_cfg.backend == "transformers" and kernel is not None:
            self.decoder = StaticDecoder(self.target.model, meta.layer_ids, target_cfg.static_len,
                                         kernel_gemm(self.target, target_cfg, kernel), kernel)
        tok = self.target.tokenizer
        self.stop_ids = [i for i in stop_token_ids(tok) if i is not None and i >= 0] or [tok.eos_token_id]
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.stop_ids[0]
        self.vllm = VllmGenerator(self.target.name_or_path, data_cfg) if data_cfg.backend == "vllm" else None
        self.seconds = {"generate": 0.0, "capture": 0.0}

    def __call__(self, prompts: Sequence[Prompt],
                 on_batch: Callable[[list[Record]], None] | None = None) -> list[Record]:
        """Records of ``prompts``, rolled out ``data.batch_size`` at a time (``on_batch`` after each)."""
        if self.decoder is not None:
            t0 = time.perf_counter()
            records = slab_rollouts(self.decoder, prompts, self.cfg, self.stop_ids, self.meta, self.cfg.batch_size,
                                    on_batch)
            self.seconds["generate"] += time.perf_counter() - t0  # capture is inside generation
            return records
        records: list[Record] = []
        for i in range(0, len(prompts), self.cfg.batch_size):
            batch = prompts[i:i + self.cfg.batch_size]
            t0 = time.perf_counter()
            if self.vllm is not None:
                responses = self.vllm(batch, self.stop_ids)
            else:
                responses = generate(self.target, batch, self.cfg, self.stop_ids, self.pad_id)
            t1 = time.perf_counter()
            done = capture(self.target, batch, responses, self.meta, self.pad_id)
            records += done
            self.seconds["generate"] += t1 - t0
            self.seconds["capture"] += time.perf_counter() - t1
            if on_batch is not None:
                on_batch(done)
        return records

    def decode(self, record: Record) -> dict[str, str]:
        tok = self.target.tokenizer
        return {"sample_id": record.sample_id,
                "prompt": tok.decode(record.input_ids[:record.prompt_len].tolist()),
                "response": tok.decode(record.input_ids[record.prompt_len:].tolist())}


def prompt_rows(prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    return [{"sample_id": p.prompt_id, "input_ids": list(p.input_ids), "seed": p.seed} for p in prompts]


def rows_to_prompts(rows: dict[str, Any]) -> list[Prompt]:
    """A numpy batch of prompt rows (from :func:`prompt_rows`) → prompts."""
    return [Prompt(str(sid), tuple(int(t) for t in ids), int(seed))
            for sid, ids, seed in zip(rows["sample_id"], rows["input_ids"], rows["seed"])]


def config_kwargs(target_cfg: TargetConfig, data_cfg: DataConfig, meta: RecordMeta) -> dict[str, Any]:
    """Constructor kwargs for an actor class (plain dataclasses: picklable)."""
    return {"target_cfg": dataclasses.replace(target_cfg), "data_cfg": dataclasses.replace(data_cfg), "meta": meta}
