"""``StepTarget``: a ``Target`` whose passes run the static-slab decoder of ``step.py`` with the
weight-streaming kernel of ``kernels/`` (``target.step: fast``): batch-1 chains, and the batch
engine's rounds over the rows of one slab (``engine.cache.slots``).

    target = load_target(cfg)
    fast = step_target(target, cfg, taps=drafter.layer_ids)   # a StepTarget, or target itself
    out = fast.forward(ids, layer_ids=drafter.layer_ids, use_cache=True)   # out.cache: StaticCache

A decode step reads every weight once; the transformers forward on this kind of CPU runs at
about 3.5x the time that takes (MKL's one-row product streams at half the memory's pace, a few
rows cost up to twice one row, and per-op overhead adds more; docs/results.md). The fast step
streams each weight row once for all the pass's rows (``kernels/rows_gemm.c``), keeps its KV
cache in place (``StaticCache``) and runs fewer ops per layer (``StaticDecoder``).

Passes the decoder does not serve (a padded batch with an attention mask, explicit position
ids, an HF cache, taps outside ``taps``) go to the transformers forward, so a ``StepTarget`` is a
drop-in ``Target``: the chain engines, the plain baseline and the batch engine (which sees
``batch_cache == "slots"``) reach the fast path; the tree engine (which gathers cache rows of
an HF cache) keeps the transformers one. Knows the ``Target`` API, the slot cache's bookkeeping
and the kernel's loader; nothing about drafters or engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from components.config import TINY_TARGET, TargetConfig
from components.drafters.capabilities import Capability, has
from components.engine.cache.prefix import PrefixStore
from components.engine.cache.slots import SlotCache, SlotPool
from components.target.blocks import BLOCK, BlockIndex, quantize_q8_0
from components.target.draft_layers import KernelLayers
from components.target.hf import Target, TargetError, TargetOutput
from components.target.kernels import (
    PRECISION_FORMATS,
    PRECISIONS,
    KernelUnavailable,
    PackedWeight,
    RowsGemm,
    rows_gemm,
    why_unavailable,
)
from components.target.step import (
    StaticCache,
    StaticDecoder,
    StepUnsupported,
    causal_mask,
    decoder_shape,
)

STEPS = ("auto", "fast", "hf")
STEP_WEIGHTS = ("auto", "float32")
MAX_KERNEL_ROWS = 32  # passes with more rows (a prefill) take torch's GEMM: compute-bound, MKL's ground


class KernelGemm:
    """The decoder's weight products: ``prepare`` packs each weight once (a copy, kept beside
    the tensor it came from): the checkpoint's own blocks where ``blocks`` (a
    ``blocks.BlockIndex``) holds them bit for bit, else float32 panels; a decode step's few rows
    take the kernel, more rows (a prefill) torch's GEMM on the float32 weight."""

    def __init__(self, kernel: RowsGemm, blocks: BlockIndex | None = None):
        self.kernel, self.blocks = kernel, blocks
        self.packed: dict[str, int] = {}  # format → weights packed in it (counted once each)

    def prepare(self, w: Tensor) -> PackedWeight:
        found = self.blocks.find(w) if self.blocks is not None else None
        packed = self.kernel.pack_blocks(found, w) if found is not None else self.kernel.pack(w)
        self.packed[packed.format] = self.packed.get(packed.format, 0) + 1
        return packed

    def summary(self) -> str:
        """What ``prepare`` packed, e.g. 'weights: 61 as q4_1 blocks, 1 as q8_0 blocks'."""
        if set(self.packed) <= {"f32"}:
            return "weights: float32 panels"
        inputs = {f: f" (inputs in {self.kernel.precision})" for f in PRECISION_FORMATS[self.kernel.precision]}
        return "weights: " + ", ".join(f"{n} as {f} blocks{inputs.get(f, '')}" if f != "f32" else f"{n} as float32 panels"
                                      for f, n in sorted(self.packed.items()))

    def __call__(self, x: Tensor, w: PackedWeight | Tensor) -> Tensor:
        if x.numel() // x.shape[-1] <= MAX_KERNEL_ROWS:
            return self.kernel.linear(x, w)
        return torch.nn.functional.linear(x, w.weight if isinstance(w, PackedWeight) else w)


class StepTarget(Target):
    """``target``'s model behind the static-slab decoder; ``gemm`` does its weight products.
    The batch engine keeps its running batch in rows of one slab (``slot_pool``, ``SlotCache``):
    a round is one pass over every row's new tokens, each row at its own positions."""

    batch_cache = "slots"

    def __init__(self, target: Target, taps: Sequence[int] = (), capacity: int = 2048,
                 gemm: Callable[[Tensor, Any], Tensor] | None = None, kernels: Any = None):
        super().__init__(target.model, target.tokenizer, target.name_or_path)
        self.block_source = target.block_source
        self.decoder = StaticDecoder(target.model, self.check_layer_ids(taps), capacity, gemm, kernels)
        self.taps = self.decoder.taps
        self._picks: dict[tuple[int, ...], list[int] | slice] = {}  # layer ids asked for -> their places among taps
        self.capacity = capacity
        packed = getattr(gemm, "packed", {})
        self.weight_formats = tuple(sorted(f for f in packed if f != "f32")) or ("f32",)
        # the block products' precision (kernels.PRECISIONS): where it changes a product this step
        # runs, every pass must take this step, since the transformers forward computes in float32
        self.precision = getattr(kernels, "precision", "float32")
        self._own_arithmetic = bool(set(PRECISION_FORMATS[self.precision]) & set(self.weight_formats))

    def new_cache(self) -> StaticCache:
        return StaticCache(*self.decoder.new_slab(1))

    @property
    def forward_kind(self) -> str:
        weights = "" if self.weight_formats == ("f32",) else f", {'/'.join(self.weight_formats)} blocks"
        kernels = self.decoder.kernels
        # the kernel's build (ISA and source hash) too: a changed kernel re-measures round profiles
        built = f"kernel {kernels.path.stem.removeprefix('rows_gemm-')}" if kernels is not None else "torch"
        # a batch round's head on its blocks at every row count (``StaticDecoder._head_rows``): profiles
        # timed while rounds past 32 rows took torch's float32 head are measured again
        head = ", head on its blocks" if self.decoder.head_on_blocks else ""
        return f"fast step, {built}{weights}{head}, {self.capacity} slots"

    @property
    def prefill_threads(self) -> int:
        """The kernels' threads in the batch engine's prompt passes (``prefill_slot``; 0: torch's
        threads, as every other pass). A prefill is arithmetic-bound and wide, and it stalls every
        running row while it lasts: worth every core where a decode step, memory-bound and
        narrow, is not (``serve.prefill_threads``). The same bits at any count."""
        return self.decoder.prefill_threads

    @prefill_threads.setter
    def prefill_threads(self, threads: int) -> None:
        if threads < 0:
            raise ValueError(f"prefill_threads must be >= 0, got {threads}")
        self.decoder.prefill_threads = int(threads)

    def slot_pool(self, rows: int) -> SlotPool:
        """A slab of ``rows`` sequences of ``capacity`` slots each, for the batch engine."""
        return SlotPool(*self.decoder.new_slab(rows))

    def prefill_slot(self, pool: SlotPool, input_ids: Tensor, layer_ids: Sequence[int] = (),
                     prefixes: PrefixStore | None = None) -> TargetOutput:
        """One sequence's prompt ``input_ids`` [1, P] into a free row of ``pool`` → logits of its
        last token [1, 1, V], taps of ``layer_ids``, and ``cache``: a ``SlotCache`` of that one row.
        ``prefixes``: the prompt's longest kept prefix is copied from it instead of computed, where
        the pass asks for no taps and leaves at least ``prefix_tail`` tokens (``last`` then covers
        the computed ones only); the prompt's blocks are kept in it for the prompts after it."""
        count = input_ids.shape[1]
        if count > pool.slots:
            raise TargetError(f"target.static_len: a prompt of {count} tokens is past the fast step's {pool.slots} "
                              "cache slots; raise target.static_len (or set target.step: hf)")
        row = pool.acquire()
        ids = input_ids[0].tolist() if prefixes is not None else []
        tail = self.prefix_tail
        reuse = prefixes is not None and tail is not None and not layer_ids  # a cached prefix has no taps
        start = prefixes.load(ids, pool.k, pool.v, row, count - tail) if reuse else 0
        logits, taps, last = self.decoder.prefill_row(input_ids, pool.k, pool.v, row, start)
        if prefixes is not None:
            prefixes.keep(ids, pool.k, pool.v, row)
        return TargetOutput(logits, self._pick(taps, layer_ids), last, SlotCache(pool, [row], [count]))

    @property
    def prefix_tail(self) -> int | None:
        """The fewest tokens a prefill may compute after a kept prefix and still give the bits of
        the whole prompt's pass (``RowsGemm.same_bits_rows``: the kernels' rows take the same
        sums; the attention's and the layers' other work are per row); None: never split."""
        return self.decoder.kernels.same_bits_rows if self.decoder.kernels is not None else None

    def _pick(self, taps: Tensor, layer_ids: Sequence[int]) -> Tensor | None:  # [..., n, H] -> [..., len(ids), H]
        key = tuple(layer_ids)
        pick = self._picks.get(key)
        if pick is None:  # checked and looked up once per set of ids; every tap in order: all of them
            found = [self.taps.index(i) for i in self.check_layer_ids(layer_ids)]
            pick = self._picks[key] = slice(None) if found and found == list(range(len(self.taps))) else found
        if isinstance(pick, slice):
            return taps
        return taps[..., pick, :] if pick else None

    def _forward_slots(self, input_ids: Tensor, cache: SlotCache, layer_ids: Sequence[int]) -> TargetOutput:
        """ids [B, W]: row b's new tokens at slots lengths[b].. of slab row rows[b] → logits
        [B, W, V]. Only a row's real tokens (``cache.new_tokens``, else all W) go through the
        kernel, as ragged rows; the padding's outputs are zeros, never read."""
        b, w = input_ids.shape
        if cache.length + w > cache.pool.slots:
            raise TargetError(f"target.static_len: a sequence of {cache.length + w} tokens is past the fast step's "
                              f"{cache.pool.slots} cache slots; raise target.static_len (or set target.step: hf)")
        counts = cache.new_tokens if cache.new_tokens is not None else [w] * b  # [B] a row's real tokens, then padding
        # the rows' slab rows and slots as lists first: a few torch ops here cost more than the lists
        seq = torch.tensor([r for r, c in zip(cache.rows, counts) for _ in range(c)], dtype=torch.long)  # [N]
        pos = torch.tensor([n + j for n, c in zip(cache.lengths, counts) for j in range(c)], dtype=torch.long)  # [N]
        padded = sum(counts) < b * w
        real = torch.tensor([[j < c for j in range(w)] for c in counts]) if padded else None  # [B, W]
        ids = input_ids[real] if real is not None else input_ids.reshape(-1)
        logits, taps, last = self.decoder.forward_rows(ids, seq, pos, cache.pool.k, cache.pool.v)
        picked = self._pick(taps, layer_ids)  # [N, n, H] or None
        if real is None:
            return TargetOutput(logits.view(b, w, -1), picked.view(b, w, *picked.shape[1:]) if picked is not None
                                else None, last.view(b, w, -1), cache)
        return TargetOutput(_spread(logits, real), _spread(picked, real) if picked is not None else None,
                            _spread(last, real), cache)

    def serves(self, input_ids: Tensor, attention_mask: Tensor | None, layer_ids: Sequence[int], cache: Any,
               position_ids: Tensor | None) -> bool:
        """Whether the static decoder runs this pass (else the transformers forward does)."""
        return (input_ids.shape[0] == 1 and attention_mask is None and position_ids is None
                and (cache is None or isinstance(cache, StaticCache)) and set(layer_ids) <= set(self.taps))

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, layer_ids: Sequence[int] = (),
                cache: Any = None, use_cache: bool = False, position_ids: Tensor | None = None,
                last_logits: bool = False) -> TargetOutput:
        if isinstance(cache, SlotCache):  # the batch engine's round; its positions are the slots'
            out = self._forward_slots(input_ids, cache, layer_ids)
            return dataclasses.replace(out, logits=out.logits[:, -1:]) if last_logits else out
        if not self.serves(input_ids, attention_mask, layer_ids, cache, position_ids):
            if self._own_arithmetic:
                raise TargetError(f"target.step_precision: {self.precision}: a pass the fast step does not run (a padded "
                                  "batch, position ids, an HF cache or taps it was not built with) would compute in "
                                  "float32 and differ from the target's own output; set target.step_precision: float32")
            return super().forward(input_ids, attention_mask, layer_ids, cache, use_cache, position_ids, last_logits)
        if cache is None:
            cache = self.new_cache()
        count, start = input_ids.shape[1], cache.length
        if start + count > self.capacity:
            raise TargetError(f"target.static_len: a sequence of {start + count} tokens is past the fast step's "
                              f"{self.capacity} cache slots; raise target.static_len (or set target.step: hf)")
        pos = torch.arange(start, start + count, device=input_ids.device).unsqueeze(0)  # [1, T]
        logits, taps, last = self.decoder(input_ids, pos, start, causal_mask(start, count, input_ids.device),
                                          cache.k, cache.v, last_only=last_logits)
        cache.length = start + count
        return TargetOutput(logits, self._pick(taps, layer_ids), last, cache)

    __call__ = forward


def step_wanted(cfg: TargetConfig, target: Target) -> tuple[bool, str]:
    """(whether to run the fast step, why not) for ``target.step``: ``auto`` is fast where it is
    declared able to run (a float32 CPU target of a known family, the kernel's CPU and compiler
    present), the tiny test fixture excepted; ``fast`` makes every reason not to an error."""
    if cfg.step not in STEPS:
        raise TargetError(f"target.step: '{cfg.step}' is not one of {list(STEPS)}")
    if cfg.step == "hf":
        return False, "target.step: hf"
    reasons = []
    try:
        decoder_shape(target.model)
    except StepUnsupported as err:
        reasons.append(f"{target.name_or_path}: {err}")
    if target.device.type != "cpu" or target.dtype != torch.float32:
        reasons.append(f"the kernel runs float32 on the CPU, the target is {target.dtype} on {target.device.type}")
    why = why_unavailable()
    if why:
        reasons.append(why)
    if reasons and cfg.step == "fast":
        raise TargetError(f"target.step: fast, but {'; '.join(reasons)}; set target.step: hf")
    if cfg.step == "auto" and cfg.name_or_path == TINY_TARGET:
        reasons.append("the tiny test fixture (set target.step: fast to use it there)")
    return not reasons, "; ".join(reasons)


def wanted_kernel(target: Target, cfg: TargetConfig) -> tuple[RowsGemm | None, str]:
    """(the kernel of ``target.step_precision``, "") where ``target.step`` chooses the fast step
    and the kernel builds, else (None, why not); ``fast`` makes a failed build an error, and so
    does a precision other than float32 that the fast step cannot run (it asks for this step)."""
    if cfg.step_precision not in PRECISIONS:
        raise TargetError(f"target.step_precision: '{cfg.step_precision}' is not one of {list(PRECISIONS)}")
    wanted, why = step_wanted(cfg, target)
    asked = cfg.step == "fast" or cfg.step_precision != "float32"
    if not wanted:
        if cfg.step_precision != "float32":
            raise TargetError(f"target.step_precision: {cfg.step_precision} runs in the fast step, which does not "
                              f"run here ({why}); set target.step_precision: float32")
        return None, why
    if cfg.step_precision != "float32" and (cfg.step_weights == "float32" or target.block_source is None):
        none = "target.step_weights: float32" if cfg.step_weights == "float32" else \
            f"{target.name_or_path} stores its weights unquantized"
        raise TargetError(f"target.step_precision: {cfg.step_precision} acts on the checkpoint's blocks, and this "
                          f"step reads none ({none}); set target.step_precision: float32")
    try:
        return rows_gemm(Path(cfg.cache_dir) / "kernels", cfg.step_precision), ""
    except KernelUnavailable as err:
        if asked:
            key = "step: fast" if cfg.step_precision == "float32" else f"step_precision: {cfg.step_precision}"
            raise TargetError(f"target.{key}, but {err}") from None
        return None, str(err)


def block_index(target: Target, cfg: TargetConfig) -> tuple[BlockIndex | None, str]:
    """(the checkpoint's blocks, "") where ``target.step_weights`` lets the fast step read them and
    the target declares a block-quantized checkpoint (``Target.block_source``), else (None, why)."""
    if cfg.step_weights not in STEP_WEIGHTS:
        raise TargetError(f"target.step_weights: '{cfg.step_weights}' is not one of {list(STEP_WEIGHTS)}")
    if cfg.step_weights == "float32":
        return None, "target.step_weights: float32"
    if target.block_source is None:
        return None, f"{target.name_or_path} stores its weights unquantized"
    return BlockIndex.from_gguf(target.block_source), ""


def kernel_gemm(target: Target, cfg: TargetConfig, kernel: RowsGemm) -> KernelGemm:
    """The fast step's products for ``target``: reading the checkpoint's blocks where
    ``block_index`` allows (each weight checked to decode to the float32 one bit for bit)."""
    return KernelGemm(kernel, block_index(target, cfg)[0])


def step_target(target: Target, cfg: TargetConfig, taps: Sequence[int] = (),
                lines: Callable[[str], None] | None = None) -> Target:
    """``target`` behind the fast step (its kernel built under ``target.cache_dir`` once per
    machine, about a second), or ``target`` itself where ``target.step`` says not to."""
    kernel, why = wanted_kernel(target, cfg)
    if kernel is None:
        if lines:
            lines(f"target step: transformers ({why})")
        return target
    gemm = kernel_gemm(target, cfg, kernel)
    fast = StepTarget(target, taps, cfg.static_len, gemm, kernel)
    gemm.blocks = None  # every weight is packed: the index is not needed again
    if lines:
        lines(f"target step: fast (static KV cache of {cfg.static_len} slots, kernel {kernel.path.name}; "
              f"{gemm.summary()})")
    return fast


class StreamingLinear(torch.nn.Linear):
    """An ``nn.Linear`` (no bias, float32, CPU) whose products of a few rows, outside autograd,
    run the weight-streaming kernel on its packed copy; larger or differentiable ones torch's."""

    packed: Any = None  # kernels.PackedWeight of this module's weight, set by ``stream_linears``
    kernel: Any = None  # kernels.RowsGemm

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] <= MAX_KERNEL_ROWS and not torch.is_grad_enabled() and x.dtype == torch.float32:
            return self.kernel.linear(x, self.packed)
        return super().forward(x)


DRAFT_WEIGHTS = ("auto", "q8_0", "float32")


def stream_linears(target: Target, cfg: TargetConfig, lines: Callable[[str], None] | None = None,
                   modules: Sequence[torch.nn.Module] | None = None, keep_target: bool = False) -> int:
    """Where ``target.step`` chose the fast step: every bias-free linear layer of ``modules``
    (default: ``target``'s model, for engines that keep the transformers forward: the batch
    engine that serves, the data stage's rollouts; also a drafter) becomes a ``StreamingLinear``,
    its weight packed beside it (a copy); the number changed (0 where not chosen). In place.
    ``keep_target``: leave the target model's own layers as they are, even where ``modules``
    share them (a drafter reading the target's head), and pack the others as
    ``target.draft_weights`` says (Q8_0 blocks, quantized here, or float32 panels): they are a
    drafter's, whose products need not be exact. The target's own are packed as float32. A
    drafter among ``modules`` declaring ``Capability.LAYER_KERNEL`` also runs its batch-1 draft
    blocks' decoder layers one kernel call each (``draft_layers.KernelLayers``, same packing)."""
    if cfg.draft_weights not in DRAFT_WEIGHTS:
        raise TargetError(f"target.draft_weights: '{cfg.draft_weights}' is not one of {list(DRAFT_WEIGHTS)}")
    kernel, why = wanted_kernel(target, cfg)
    changed, kept = 0, {id(m) for m in target.model.modules()} if keep_target else set()
    quantize = keep_target and cfg.draft_weights != "float32"

    def pack(w: Tensor) -> PackedWeight:
        blocks = quantize_q8_0(w) if quantize and w.shape[1] % BLOCK == 0 else None
        return kernel.pack_blocks(blocks, w) if blocks is not None else kernel.pack(w)

    roots = (modules if modules is not None else [target.model]) if kernel is not None else ()
    for root in roots:
        for module in root.modules():
            if (type(module) is torch.nn.Linear and module.bias is None and module.weight.dtype == torch.float32
                    and id(module) not in kept):
                module.packed = pack(module.weight.detach())
                module.__class__ = StreamingLinear
                module.kernel = kernel
                changed += 1
    fused = 0
    for root in roots if keep_target else ():  # a drafter's block layers: one kernel call each
        if has(root, Capability.LAYER_KERNEL):
            layers, sizes = root.kernel_layers()
            root.use_layer_kernel(KernelLayers(kernel, layers, sizes, pack))
            fused += len(layers)
    if lines:
        how = "as q8_0 blocks" if quantize else "as float32"
        lines((f"linears: {changed} streamed by the kernel {how}" + (f", {fused} draft layers fused" if fused else ""))
              if changed else f"linears: torch's ({why})")
    return changed


def _spread(rows: Tensor, real: Tensor) -> Tensor:
    """rows [N, ...] of the real positions of real [B, W] → [B, W, ...], zeros at the padding."""
    out = rows.new_zeros(*real.shape, *rows.shape[1:])
    out[real] = rows
    return out
