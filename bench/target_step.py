"""The target's step against the memory floor: T(k), one pass of k new tokens over a
``--context``-token KV cache, for the transformers forward (``target.step: hf``) and the fast
step (``fast``: static slab + our weight-streaming kernel) reading float32 panels
(``target.step_weights: float32``) and reading the checkpoint's own Q4_1 / Q8_0 blocks
(``auto``; and through the kernel built for each other instruction set the CPU runs, e.g. AVX-512
and AVX2 beside AMX, and with the AVX-512 build's other Q4_1 decoding and, where the CPU declares
AVX-512 BF16 or VNNI, its products of bfloat16 or 8-bit integer inputs: ``target.step_precision:
bfloat16`` / ``int8``), beside the floor measured in the same run: the seconds a pass needs to read every
weight once, taken from a sum over a tensor of the bytes each reads (the bandwidth one pass can
use at that thread count).

    python bench/target_step.py [--threads 1,2 --context 256 --new-tokens 1,2,4,8,16 --reps 15
                                 --cache-dir DIR]

Prints a markdown table: per thread count and k, the medians of hf, fast and fast on blocks
(interleaved, so load from other processes falls on all alike), the blocks step alone (its passes
one after another, so that only its weights cycle through the caches, as in a served step: on a
CPU whose last-level cache holds the blocks, its one-token pass runs well under the interleaved
one), each fast step over its floor,
the arithmetic's own floor (the pass's FLOPs at the kernel's vector FMA peak, measured in the
same run; a large float32 matrix product's rate beside it), T(k)/T(1) of each and the speedups. Also the arithmetic beside it: GFLOP per pass. SmolLM2-135M-Instruct in
float32 (converted once into ``--cache-dir``). Nothing is asserted; the numbers describe this
machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import SMOLLM2_TARGET, TargetConfig
from components.engine.core import crop_cache
from components.target import load_target
from components.target.fast import StepTarget, kernel_gemm, step_target
from components.target.kernels import Q41_DECODES, RowsGemm, isas, precisions, q41_decode

PRECISION_TAGS = {"bfloat16": "bf16", "int8": "int8", "int16": "int16"}  # the variants' labels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--new-tokens", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--cache-dir", default=str(Path("~/.cache/specline/targets").expanduser()))
    return p.parse_args(argv)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        clock = time.perf_counter()
        fn()
        times.append(time.perf_counter() - clock)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = TargetConfig(name_or_path=SMOLLM2_TARGET, dtype="float32", device="cpu", cache_dir=args.cache_dir, step="fast")
    hf = load_target(cfg)
    steps, best, others = _steps(hf, cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.model.parameters())
    read_bytes = {name: _bytes_read(t) for name, t in steps.items()}  # what one decode pass streams
    params = sum(p.numel() for p in hf.model.parameters())
    ks = [int(k) for k in args.new_tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (1, args.context + max(ks)), generator=gen)
    caches = {"hf": hf.forward(ids[:, :args.context], use_cache=True).cache}
    caches.update({name: t.forward(ids[:, :args.context], use_cache=True).cache for name, t in steps.items()})
    targets = {"hf": hf, **steps}
    blocks = {name: torch.randn(n // 4, generator=gen) for name, n in read_bytes.items()}  # as many bytes as each reads

    def run_pass(name: str, k: int) -> None:
        crop_cache(caches[name], args.context)
        targets[name].forward(ids[:, args.context:args.context + k], cache=caches[name], use_cache=True)

    print(f"SmolLM2-135M: {weight_bytes / 1e6:.0f} MB of float32 weights; a pass reads {read_bytes['fast'] / 1e6:.0f} MB "
          f"as float32 panels, {read_bytes['blocks'] / 1e6:.0f} MB as the checkpoint's blocks "
          f"({', '.join(steps['blocks'].weight_formats)}); context {args.context}, {args.reps} reps, medians; "
          f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}, kernel {best.isa}{f' ({best.q41} Q4_1)' if best.isa == 'avx512' else ''}"
          f"{''.join(f', blocks {isa} beside it' for isa in others)}\n")
    print("| threads | floor ms f32 / blocks (GB/s) | k | GFLOP | arithmetic ms at the FMA peak (GFLOP/s; sgemm's) | hf ms | "
          "fast ms | blocks ms | " + "".join(f"blocks {isa} ms | " for isa in others) + "fast / floor | blocks / its floor | "
          "hf T(k)/T(1) | fast T(k)/T(1) | blocks T(k)/T(1) | blocks alone ms | blocks alone T(k)/T(1) | "
          "blocks over fast | blocks over hf |" + "".join(f" blocks over {isa} |" for isa in others))
    print("|---" * (17 + 2 * len(others)) + "|")
    square = torch.randn(1024, 1024, generator=gen)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for k in ks:  # warm-up
            for name in targets:
                run_pass(name, k)
        floor = {name: median_ms(lambda b=b: b.sum(), args.reps) for name, b in blocks.items()}
        sgemm = 2 * 1024 ** 3 / median_ms(lambda: square @ square, args.reps) / 1e6  # GFLOP/s of a large sgemm
        flops = best.fma_rate(threads)  # the vector units' own ceiling
        rows = _timed(list(targets), ks, args.reps, run_pass)
        first = rows[ks[0]]
        for k in ks:
            r = rows[k]
            print(f"| {threads} | {floor['fast']:.1f} / {floor['blocks']:.1f} ({read_bytes['fast'] / floor['fast'] / 1e6:.1f}) "
                  f"| {k} | {2 * params * k / 1e9:.2f} | {2 * params * k / 1e6 / flops:.1f} ({flops:.0f}; {sgemm:.0f}) | "
                  f"{r['hf']:.1f} | {r['fast']:.1f} | {r['blocks']:.1f} | "
                  + "".join(f"{r[f'blocks {isa}']:.1f} | " for isa in others) +
                  f"{r['fast'] / floor['fast']:.2f} | {r['blocks'] / floor['blocks']:.2f} | {r['hf'] / first['hf']:.2f} | "
                  f"{r['fast'] / first['fast']:.2f} | {r['blocks'] / first['blocks']:.2f} | {r['alone']:.1f} | "
                  f"{r['alone'] / first['alone']:.2f} | {r['fast'] / r['blocks']:.2f}x | "
                  f"{r['hf'] / r['blocks']:.2f}x |" + "".join(f" {r[f'blocks {isa}'] / r['blocks']:.2f}x |" for isa in others),
                  flush=True)


def _timed(names: list[str], ks: list[int], reps: int, run_pass: Any) -> dict[int, dict[str, float]]:
    """Per k: each step's median ms over ``reps`` passes, the steps interleaved, and the blocks
    step's alone (``"alone"``: its passes one after another, after three to warm it again)."""
    rows: dict[int, dict[str, float]] = {}
    for k in ks:
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(reps):  # interleaved
            for name in names:
                times[name].append(median_ms(lambda k=k, name=name: run_pass(name, k), 1))
        rows[k] = {name: statistics.median(t) for name, t in times.items()}
        for _ in range(3):  # the blocks' weights back in the caches, then its passes alone
            run_pass("blocks", k)
        rows[k]["alone"] = median_ms(lambda k=k: run_pass("blocks", k), reps)
    return rows


def _steps(hf: Any, cfg: TargetConfig) -> tuple[dict[str, StepTarget], RowsGemm, list[str]]:
    """(the fast steps timed, by name: float32 panels, the checkpoint's blocks, and the blocks through
    the kernels of the CPU's other ISAs, Q4_1 decodings and precisions; the blocks' kernel; those variants)."""
    steps = {"fast": step_target(hf, dataclasses.replace(cfg, step_weights="float32")), "blocks": step_target(hf, cfg)}
    assert all(isinstance(t, StepTarget) for t in steps.values()) and steps["blocks"].weight_formats != ("f32",)
    best = steps["blocks"].decoder.kernels
    variants = [(isa, isa, q41_decode(isa), "float32") for isa in isas() if isa != best.isa]  # each its own decoding
    if best.isa == "avx512":
        variants = [(f"{best.isa} {q41}", best.isa, q41, "float32") for q41 in Q41_DECODES if q41 != best.q41] + variants
    variants += [(f"avx512 {PRECISION_TAGS[p]}", "avx512", None, p) for p in precisions() if p != "float32"]
    for label, isa, q41, precision in variants:
        kernel = RowsGemm.build(Path(cfg.cache_dir) / "kernels", isa, q41, precision)
        steps[f"blocks {label}"] = StepTarget(hf, (), cfg.static_len, kernel_gemm(hf, cfg, kernel), kernel)
    return steps, best, [label for label, _, _, _ in variants]


def _bytes_read(target: StepTarget) -> int:
    """Bytes of the packed weights a decode pass streams (every product once, the head included)."""
    d = target.decoder
    packed = [d.head_weight] + [p for layer in d.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(p.panels.numel() * p.panels.element_size() for p in packed)


if __name__ == "__main__":
    main()
