"""Kernels of our own, built from C source with the machine's compiler at first use.

* ``layer.c``     -- one Llama-family decoder layer for the new tokens of one or more
  sequences (each row its own sequence and position in a static KV slab), in place, in one call
  (``RowsGemm.layer``, packed weights): at decode sizes torch's per-op dispatch costs more than
  the arithmetic;
* ``rows_gemm.c`` -- y = x wᵀ for a few rows x (a decode step or a verify pass: 1..17 rows):
  every weight read once as one sequential stream, all rows' products done while it is in
  cache (AVX2 + FMA, OpenMP over weight rows). MKL's sgemm on this kind of CPU reads a
  one-row product at about half the memory's pace and prices 2..8 rows far above one row
  (docs/results.md, ``bench/gemm_rows.py``); this kernel does neither. Weights packed once
  (``RowsGemm.pack``: panels of 16 rows, [ceil(N/16), K, 16]) take an outer-product kernel
  whose 2..16 rows cost little more than one (the stream, not the arithmetic, sets the pace);
  weights as they are ([N, K]) take a dot-product kernel whose extra rows cost more;
* ``rows_gemm_blocks.c`` -- the same products with the weight in the block-quantized format the
  checkpoint stores it in (Q4_1, Q8_0: ``components.target.blocks``), decoded exactly in
  registers: a pass reads 0.75 or 1.125 bytes a weight instead of 4 (``RowsGemm.pack_blocks``);
* ``rows_gemm_512.c`` -- both packed products again for CPUs with AVX-512, built in place of the
  AVX2 ones there (``isa``): a 16-float register holds a whole panel line, so a row costs one FMA
  a k, a Q4_1 line decodes without shuffles, and up to 16 rows share one read of each panel;
* ``rows_gemm_amx.c`` -- the Q4_1 products of wide passes (a prompt, many rows at once) on the
  tile unit of CPUs with AMX (``isa`` "amx": the AVX-512 build with these in place of its Q4_1
  products; passes of a few rows keep the vector tiles): float32 arithmetic carried exactly
  through bfloat16 tiles (three pieces of each input, the blocks' integers);
* ``rows_gemm_bf16.c`` -- the Q4_1 products with their inputs rounded to bfloat16, on the dot
  product unit of CPUs with AVX-512 BF16 (``precision`` "bfloat16": the AVX-512 build with these
  in place of its Q4_1 products): half the instructions a weight, and no longer float32's output;
* ``rows_gemm_int8.c`` -- the block products with their inputs quantized to 8-bit integers per
  32, on the integer dot product unit of CPUs with AVX-512 VNNI (``precision`` "int8": likewise):
  a quarter of the instructions a weight, and no longer float32's output; "int16": 16-bit
  integers in two 8-bit parts, half the instructions, nearer float32's output.

``RowsGemm.build(dir, isa)`` compiles the source into ``dir`` once (keyed by the instruction set
and a hash of the source and flags; written under a temporary name and renamed, so an interrupted build leaves nothing) and
loads it with ctypes: plain C, no torch headers, so a build takes about a second. Whether it
can run here is declared by the CPU (``torch.backends.cpu.get_cpu_capability``) and the
presence of a C compiler, never by trying. Knows float32 row-major tensors; nothing of models.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("rows_gemm.c", "rows_gemm_blocks.c", "rows_gemm_512.c", "rows_gemm_amx.c",
                                         "rows_gemm_bf16.c", "rows_gemm_int8.c", "layer.c"))
HEADERS = (HERE / "vexp.h",)  # included by the sources (and by kernels elsewhere: -I this directory)
ATTEND_CHUNK = 256  # layer.c: keys a query's attention reads per unit of work (longer contexts are merged)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", f"-DATTEND_CHUNK={ATTEND_CHUNK}")
# per instruction set: the flags that add to FLAGS (avx512: rows_gemm_512.c's packed products in
# place of the AVX2 ones); an AVX512 CPU (torch's name: AVX-512 F/BW/VL/DQ) can run either
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DROWS_GEMM_AVX512")
# amx: rows_gemm_amx.c's Q4_1 products in place of rows_gemm_512.c's (its float32 panels and Q8_0 stay)
ISA_FLAGS = {"avx2": (), "avx512": AVX512_FLAGS,
             "amx": (*AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-DROWS_GEMM_AMX")}
AMX_FLAGS = ("amx_tile", "amx_bf16")  # what /proc/cpuinfo declares where the "amx" build runs
# what a step's block products compute in: float32 (the arithmetic of the float32 model, every
# build), bfloat16 inputs (rows_gemm_bf16.c), 8-bit or 16-bit integer inputs (rows_gemm_int8.c):
# the AVX-512 build, where the CPU declares the instructions (PRECISION_CPU_FLAGS)
PRECISIONS = {"float32": (), "bfloat16": ("-mavx512bf16", "-DROWS_GEMM_BF16"),
              "int8": ("-mavx512vnni", "-mavx512vbmi", "-DROWS_GEMM_INT8"),
              "int16": ("-mavx512vnni", "-mavx512vbmi", "-DROWS_GEMM_INT16")}
# the block formats whose products each precision computes otherwise than float32 (the rest stay)
PRECISION_FORMATS = {"float32": (), "bfloat16": ("q4_1",), "int8": ("q4_1", "q8_0"), "int16": ("q4_1", "q8_0")}
# what /proc/cpuinfo declares where each precision's build runs (besides the AVX-512 build)
PRECISION_CPU_FLAGS = {"float32": (), "bfloat16": ("avx512_bf16",), "int8": ("avx512_vnni", "avx512vbmi"),
                       "int16": ("avx512_vnni", "avx512vbmi")}
# AVX-512 only: how a Q4_1 weight becomes a float (rows_gemm_512.c): "permute" (a lookup in a table of
# 0..15: fewer instructions, measured faster on an Intel Xeon, docs/results.md) or "convert" (mask
# and convert, what the AMD EPYC host was tuned with); by the CPU's declared vendor (q41_decode)
Q41_DECODES = {"convert": (), "permute": ("-DQ41_PERMUTE",)}
CPU_ISAS = {"AVX2": ("avx2",), "AVX512": ("avx512", "avx2")}  # torch's CPU capability → ISAs it runs, best first
VECTOR_CPUS = tuple(CPU_ISAS)  # torch's names for CPUs with AVX2 and FMA


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or run here; the message says why."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def isas() -> tuple[str, ...]:
    """The instruction sets the kernel can be built for on this CPU, as declared by torch's CPU
    capability (and, for "amx", the flags of ``/proc/cpuinfo``), best first (empty where none)."""
    found = CPU_ISAS.get(torch.backends.cpu.get_cpu_capability(), ())
    if "avx512" in found and set(AMX_FLAGS) <= set((cpuinfo("flags") or "").split()):
        found = ("amx", *found)
    return found


def precisions() -> tuple[str, ...]:
    """The precisions the kernel can be built for on this CPU (``PRECISIONS``), as declared:
    float32 everywhere; the others where the CPU offers the AVX-512 build and declares their
    instructions (``PRECISION_CPU_FLAGS``: AVX-512 BF16, AVX-512 VNNI)."""
    flags = set((cpuinfo("flags") or "").split())
    return tuple(p for p, needs in PRECISION_CPU_FLAGS.items()
                 if p == "float32" or ("avx512" in isas() and set(needs) <= flags))


def cpuinfo(field: str) -> str | None:
    """What the CPU declares under ``field`` in Linux's ``/proc/cpuinfo`` (its first processor:
    ``vendor_id`` GenuineIntel / AuthenticAMD, ``model name``), or None where it declares none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), None)
    except OSError:
        return None


def request_amx() -> bool:
    """Asks Linux to let this process use the AMX tile unit (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``: from then on, in every thread; asking again is harmless); whether it may."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    return ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


def q41_decode(isa: str) -> str:
    """How the ``isa`` build turns Q4_1 weights into floats (``Q41_DECODES``) on this CPU."""
    return "permute" if isa == "avx512" and cpuinfo("vendor_id") == "GenuineIntel" else "convert"


def why_unavailable() -> str | None:
    """None where the kernel can be built and run here, else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_CPUS:
        return f"the CPU offers {capability}, the kernel needs AVX2 with FMA"
    if compiler() is None:
        return "no C compiler (gcc or $CC) to build it"
    return None


def build_library(directory: Path, stem: str, sources: Sequence[Path], flags: Sequence[str]) -> Path:
    """``sources`` compiled with ``flags`` into ``directory/<stem>-<key>.so``, once: the key hashes
    the sources, the headers beside them (``HEADERS``) and the flags; written under a temporary
    name and renamed, so an interrupted build leaves nothing. Sources may include those headers."""
    text = b"".join(src.read_bytes() for src in [*sources, *HEADERS])
    key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    path = directory / f"{stem}-{key}.so"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler(), *flags, f"-I{HERE}", "-o", tmp, *map(str, sources)], check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"building {[src.name for src in sources]} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


PANEL = 16  # weight rows per packed panel (NR in rows_gemm.c)
FORMATS = ("f32", "q4_1", "q8_0")  # a packed weight's format; its index is the code layer.c takes
LAYER_ARGS = 10  # llama_layer's pointers per layer (``RowsGemm._pointers``), the slabs k, v last
BLOCK_ROWS = 8  # AVX2: passes of up to this many rows read blocks, longer ones float32 panels (bench/target_step.py)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight [N, K] packed for ``RowsGemm.linear``: ``panels`` [ceil(N/16), K, 16] float32
    (rows past N zero), a copy, or for ``format`` q4_1 / q8_0 the checkpoint's blocks in the
    layout of ``blocks.pack_panels`` (uint8); ``weight`` is the float32 tensor it stands for (kept,
    not copied, for products the kernel does not serve, e.g. a prefill through torch's GEMM).
    ``dense``: for blocks through the AVX2 kernel, the same weight as float32 panels, which passes
    of more than ``BLOCK_ROWS`` rows read instead (there the arithmetic, not the stream, sets the
    pace, and decoding adds to it); the AVX-512 kernel decodes once per 16 rows, and its blocks are
    faster than float32 panels at every row count (docs/results.md), so it keeps none."""

    panels: Tensor
    weight: Tensor
    format: str = "f32"
    dense: PackedWeight | None = None

    def for_rows(self, rows: int) -> PackedWeight:
        """What a pass of ``rows`` rows reads: the blocks up to ``BLOCK_ROWS``, else ``dense``."""
        return self.dense if self.dense is not None and rows > BLOCK_ROWS else self

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


class RowsGemm:
    """The built ``rows_gemm`` kernel: ``linear(x, w)`` = ``x @ w.T`` for float32 ``x`` [..., K]
    and ``w`` [N, K] (or ``pack(w)``, much faster for 2+ rows) on the CPU, on ``threads``
    threads (default: torch's)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str = "avx2", q41: str = "convert",
                 precision: str = "float32"):
        self.path, self.isa, self.q41 = path, isa, q41  # q41: its Q4_1 decoding (Q41_DECODES)
        self.precision = precision  # PRECISIONS
        # the block records' layout it reads (blocks.pack_panels)
        self.nibbles = "amx" if precision != "float32" else {"avx512": "words", "amx": "amx"}.get(isa, "rows")
        gemm_args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._fn, self._packed, self._pack = lib.rows_gemm, lib.rows_gemm_packed, lib.rows_gemm_pack
        self._fn.argtypes = self._packed.argtypes = gemm_args
        self._pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._fn.restype = self._packed.restype = self._pack.restype = None
        self._blocks = {"q4_1": lib.rows_gemm_q41, "q8_0": lib.rows_gemm_q80}
        for fn in self._blocks.values():
            fn.argtypes, fn.restype = gemm_args, None
        self._fma_peak = lib.fma_peak
        self._fma_peak.argtypes, self._fma_peak.restype = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p], ctypes.c_double
        self._layer = lib.llama_layer
        self._layer.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
                                + [ctypes.c_float] + [ctypes.c_void_p] * 10
                                + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p])
        self._layer.restype = None
        self._layers = lib.llama_layers
        self._layers.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
                                 + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                                 + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                                 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64])
        self._layers.restype = ctypes.c_int64

    @property
    def same_bits_rows(self) -> int | None:
        """The fewest rows from which a pass gives each row the bits that row has in any longer
        pass (so a prompt prefilled in two parts gets the bits of one pass: ``StepTarget``'s
        prefix reuse). AVX-512: a pass of 8 or more rows has only blocks of 8 or more, and each
        of those takes one sum per row (rows_gemm_512.c; the head reads one row); the tile unit
        takes passes of 13 or more; the AVX2 build is not declared (None: never split)."""
        return {"avx512": 8, "amx": 13}.get(self.isa)

    @classmethod
    def build(cls, directory: Path, isa: str | None = None, q41: str | None = None,
              precision: str = "float32") -> RowsGemm:
        """Compiled for ``isa`` (default: the best this CPU declares, ``isas()``; AVX-512 where the
        "amx" build cannot be built or the OS refuses the tiles) into ``directory``; ``q41``: the
        AVX-512 build's Q4_1 decoding (``Q41_DECODES``; default ``q41_decode(isa)``);
        ``precision`` (``PRECISIONS``): "bfloat16" / "int8" / "int16" are the AVX-512 build with
        rows_gemm_bf16.c's / rows_gemm_int8.c's block products, where the CPU declares AVX-512 BF16 /
        VNNI."""
        why = why_unavailable()
        if why:
            raise KernelUnavailable(why)
        if precision not in PRECISIONS:
            raise ValueError(f"rows_gemm: precision {precision!r} is not one of {list(PRECISIONS)}")
        if precision != "float32":
            needs = ", ".join(PRECISION_CPU_FLAGS[precision])
            if isa not in (None, "avx512") or precision not in precisions():
                raise KernelUnavailable(f"{precision} products need the AVX-512 build on a CPU declaring {needs}; "
                                        f"the CPU offers {torch.backends.cpu.get_cpu_capability()}"
                                        + (f", asked for {isa}" if isa else ""))
            q41 = q41 or "convert"
            if q41 != "convert":
                raise ValueError(f"rows_gemm: the {precision} build has one Q4_1 decoding (convert)")
            flags = FLAGS + ISA_FLAGS["avx512"] + PRECISIONS[precision]
            tag = {"bfloat16": "bf16"}.get(precision, precision)
            path = build_library(directory, f"rows_gemm-avx512-{tag}", SOURCES, flags)
            return cls(ctypes.CDLL(str(path)), path, "avx512", q41, precision)
        if isa is None and isas()[0] == "amx":  # AMX's tiles where the OS and the compiler allow them
            try:
                return cls.build(directory, "amx", q41)
            except KernelUnavailable:
                isa = "avx512"
        isa = isa or isas()[0]
        if isa not in isas():
            raise KernelUnavailable(f"the CPU offers {torch.backends.cpu.get_cpu_capability()}, not {isa}")
        q41 = q41 or q41_decode(isa)
        if q41 not in Q41_DECODES or (q41 != "convert" and isa != "avx512"):
            raise ValueError(f"rows_gemm: no Q4_1 decoding {q41!r} for {isa} (one of {sorted(Q41_DECODES)}, AVX-512 only)")
        if isa == "amx" and not request_amx():  # asked before building: a refusal builds nothing
            raise KernelUnavailable("the OS does not let this process use AMX tiles (ARCH_REQ_XCOMP_PERM)")
        path = build_library(directory, f"rows_gemm-{isa}", SOURCES, FLAGS + ISA_FLAGS[isa] + Q41_DECODES[q41])
        return cls(ctypes.CDLL(str(path)), path, isa, q41)

    def fma_rate(self, threads: int = 1, seconds: float = 0.2) -> float:
        """GFLOP/s of this build's vector FMAs on ``threads`` threads (independent chains, no
        memory): the arithmetic's ceiling, for benchmarks to set a pass against."""
        out, n = ctypes.c_float(0.0), 1_000_000
        while True:
            clock = time.perf_counter()
            flops = self._fma_peak(n, threads, ctypes.byref(out))
            took = time.perf_counter() - clock
            if took >= seconds:
                return flops / took / 1e9
            n = int(n * min(10.0, 1.5 * seconds / max(took, 1e-6)))

    def layer(self, x: Tensor, seq: Tensor, pos: Tensor, shape: Any, weights: Any, k: Tensor, v: Tensor,
              cos: Tensor, sin: Tensor, threads: int | None = None, upto: Tensor | None = None) -> None:
        """Runs one decoder layer (``layer.c``) in place on ``x`` [T, H] (contiguous float32): row t
        is a new token of sequence ``seq[t]`` (a row of the slab ``k``/``v`` [B, h_kv, S, d],
        contiguous) at position and slot ``pos[t]`` (both int64 [T]); its key/value is written
        there and it attends to slots 0..pos[t] of its sequence, or 0..upto[t] (int64 [T]: every
        row's key/value is written before any row attends). ``shape``: ``step.Shape``;
        ``weights``: ``step._Layer`` with its products' weights packed; cos/sin [S, d]."""
        if not (k.is_contiguous() and v.is_contiguous() and seq.dtype == pos.dtype == torch.int64):
            raise KernelUnavailable("RowsGemm.layer takes a contiguous slab and int64 seq/pos")
        if upto is not None and not (upto.dtype == torch.int64 and upto.is_contiguous() and upto.shape == pos.shape):
            raise KernelUnavailable("RowsGemm.layer takes upto as contiguous int64 [T], like pos")
        template, formats, _ = self._layers_args(x.shape[0], [weights], ())
        pointers = [*template[:LAYER_ARGS - 2], k.data_ptr(), v.data_ptr()]
        self._layer(x.data_ptr(), x.shape[0], seq.data_ptr(), pos.data_ptr(), shape.hidden, shape.heads, shape.kv_heads,
                    shape.head_dim, weights.down.shape[1], shape.eps, *pointers, k.shape[2], cos.data_ptr(),
                    sin.data_ptr(), threads or torch.get_num_threads(), formats, None if upto is None else upto.data_ptr())

    def layers(self, x: Tensor, seq: Tensor, pos: Tensor, shape: Any, weights: Sequence[Any], k: Sequence[Tensor],
               v: Sequence[Tensor], cos: Tensor, sin: Tensor, threads: int | None = None,
               taps: Sequence[int] = (), ids: Tensor | None = None, table: Tensor | None = None,
               norm: Tensor | None = None, normed: Tensor | None = None) -> Tensor:
        """``layer`` for every layer of ``weights`` in turn (layer i on the slab k[i]/v[i]), in one
        call: the same bits as one ``layer`` call each, without a Python call per layer. → x after
        each layer of ``taps`` (in that order), [T, len(taps), H]. ``table`` [V, H] (the
        embeddings) with ``ids`` [T] int64: x's rows are first set to table[ids] (x's contents
        are not read); ``norm`` [H] with ``normed`` [R, H]: the last R rows of x after the last
        layer, RMS-normalised into ``normed``. Both in the same call (``llama_layers``)."""
        t = x.shape[0]
        if not all(s.is_contiguous() for s in (*k, *v)) or not seq.dtype == pos.dtype == torch.int64:
            raise KernelUnavailable("RowsGemm.layers takes contiguous slabs and int64 seq/pos")
        if not len(weights) == len(k) == len(v):
            raise ValueError(f"RowsGemm.layers: {len(weights)} layers, {len(k)} / {len(v)} slabs")
        if table is not None and not (ids is not None and ids.dtype == torch.int64 and ids.is_contiguous()
                                      and ids.shape == (t,) and table.dtype == torch.float32
                                      and table.is_contiguous() and table.shape[1:] == (shape.hidden,)):
            raise ValueError("RowsGemm.layers: table [V, H] float32 and ids [T] int64, both contiguous")
        if norm is not None and not (normed is not None and normed.is_contiguous() and norm.is_contiguous()
                                     and normed.dtype == norm.dtype == torch.float32 and normed.shape[0] <= t
                                     and normed.shape[1:] == norm.shape == (shape.hidden,)):
            raise ValueError("RowsGemm.layers: norm [H] and normed [R ≤ T, H], float32 and contiguous")
        template, formats, tap_of = self._layers_args(t, weights, tuple(taps))
        ptrs = type(template).from_buffer_copy(template)  # this call's own: the slabs' addresses go in
        ptrs[LAYER_ARGS - 2::LAYER_ARGS] = [s.data_ptr() for s in k]
        ptrs[LAYER_ARGS - 1::LAYER_ARGS] = [s.data_ptr() for s in v]
        out = x.new_empty(t, len(taps), shape.hidden)
        bad = self._layers(x.data_ptr(), t, seq.data_ptr(), pos.data_ptr(), shape.hidden, shape.heads,
                           shape.kv_heads, shape.head_dim, weights[0].down.shape[1], shape.eps, len(weights), ptrs,
                           formats, k[0].shape[2], cos.data_ptr(), sin.data_ptr(), threads or torch.get_num_threads(),
                           None, tap_of, out.data_ptr(), len(taps),
                           None if table is None else ids.data_ptr(), None if table is None else table.data_ptr(),
                           0 if table is None else table.shape[0], None if norm is None else norm.data_ptr(),
                           None if norm is None else normed.data_ptr(), 0 if norm is None else normed.shape[0])
        if bad >= 0:
            raise IndexError(f"RowsGemm.layers: token id {int(ids[bad])} (row {bad}) is outside the "
                             f"embedding table's {table.shape[0]} rows")
        return out

    def _layers_args(self, rows: int, weights: Sequence[Any], taps: tuple[int, ...]) -> tuple[Any, Any, Any]:
        """(``llama_layers``' pointers of every layer with the slabs' left empty, the products'
        formats, each layer's place among ``taps`` or -1) for a pass of ``rows`` rows: fixed per
        weights, pass length and taps, so built once and kept on the first layer's record (the
        products' packed copies and the norms' copies, ``step._Layer``, live as long as it)."""
        cache = weights[0].__dict__.setdefault("_layers_args", {})
        key = (rows > BLOCK_ROWS, len(weights), taps)
        if key not in cache:
            ptrs: list[int | None] = []
            formats: list[int] = []
            for w in weights:
                pointers, fmt = self._pointers(rows, w)
                ptrs += pointers
                formats += fmt
            tap_of = [-1] * len(weights)
            for j, i in enumerate(taps):
                tap_of[i] = j
            cache[key] = ((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int32 * len(formats))(*formats),
                          (ctypes.c_int64 * len(tap_of))(*tap_of))
        return cache[key]

    def bound_product(self, x: Tensor, w: PackedWeight, y: Tensor, threads: int | None = None) -> Callable[[], None]:
        """``y = x @ w.T`` (x [M, K], y [M, N], contiguous float32) as a call with its arguments
        bound: no checks or allocation per call, for timing the kernel's product alone."""
        w = w.for_rows(x.shape[0])
        n, k = w.shape
        if not (x.is_contiguous() and y.is_contiguous() and x.shape[1] == k and y.shape == (x.shape[0], n)):
            raise ValueError(f"bound_product: x {tuple(x.shape)}, y {tuple(y.shape)} against a weight [{n}, {k}]")
        self._check(x, y)
        fn = self._blocks[w.format] if w.format != "f32" else self._packed
        args = (x.data_ptr(), w.panels.data_ptr(), y.data_ptr(), x.shape[0], k, n, threads or torch.get_num_threads())
        return lambda: fn(*args)

    def _pointers(self, rows: int, w: Any) -> tuple[list[int | None], tuple[int, ...]]:
        """(llama_layer's LAYER_ARGS pointers of one layer: norm1, qkv, q_norm, k_norm, o, norm2,
        gate|up, down, then k, v left None for the caller; its products' formats) for a pass of
        ``rows`` rows (up to BLOCK_ROWS rows, or more)."""
        (qkv, o, gate_up, down), formats = self._products(rows, w)

        def ptr(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()
        return [ptr(w.norm1), qkv, ptr(w.q_norm), ptr(w.k_norm), o, ptr(w.norm2), gate_up, down, None, None], formats

    @staticmethod
    def _products(rows: int, w: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the panels' addresses of qkv, o, gate|up, down, their formats) for a pass of ``rows``
        rows: the layer's packed copies, which live as long as ``w``."""
        products = (w.qkv, w.o, w.gate_up, w.down)
        if not all(isinstance(p, PackedWeight) for p in products):
            raise KernelUnavailable("RowsGemm.layer takes packed weights (RowsGemm.pack)")
        products = tuple(p.for_rows(rows) for p in products)
        return tuple(p.panels.data_ptr() for p in products), tuple(FORMATS.index(p.format) for p in products)

    @staticmethod
    def _check(*tensors: Tensor) -> None:
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            raise KernelUnavailable("rows_gemm takes float32 CPU tensors")

    def pack(self, w: Tensor, threads: int | None = None) -> PackedWeight:
        """``w`` [N, K] packed once for ``linear`` (a copy of its size, rounded up to 16 rows)."""
        self._check(w)
        n, k = w.shape
        panels = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=torch.float32)
        self._pack(w.contiguous().data_ptr(), panels.data_ptr(), n, k, threads or torch.get_num_threads())
        return PackedWeight(panels, w)

    def pack_blocks(self, blocks: Any, weight: Tensor, threads: int | None = None) -> PackedWeight:
        """The checkpoint's blocks (``blocks.Blocks``) of the float32 ``weight`` [N, K], packed for
        ``linear`` (the caller has checked they decode to ``weight``: ``BlockIndex.find``), with
        its float32 panels as ``dense`` where this build reads those for longer passes (AVX2)."""
        from components.target.blocks import pack_panels

        if blocks.shape != weight.shape:
            raise ValueError(f"rows_gemm: blocks {tuple(blocks.shape)} for a weight {tuple(weight.shape)}")
        dense = self.pack(weight, threads) if self.isa == "avx2" else None
        return PackedWeight(pack_panels(blocks, self.nibbles), weight, blocks.format, dense)

    def linear(self, x: Tensor, w: Tensor | PackedWeight, threads: int | None = None) -> Tensor:
        """[..., K] × [N, K] (or its ``pack`` / ``pack_blocks``) → [..., N]."""
        packed = isinstance(w, PackedWeight)
        if packed:
            w = w.for_rows(x.numel() // x.shape[-1])
        weight = w.panels if packed else w.contiguous()
        if packed and w.format != "f32":
            self._check(x)
            fn = self._blocks[w.format]
        else:
            self._check(x, weight)
            fn = self._packed if packed else self._fn
        n, k = w.shape
        if x.shape[-1] != k:
            raise ValueError(f"rows_gemm: x [..., {x.shape[-1]}] against a weight [{n}, {k}]")
        flat = x.reshape(-1, k).contiguous()
        y = torch.empty(flat.shape[0], n, dtype=torch.float32)
        fn(flat.data_ptr(), weight.data_ptr(), y.data_ptr(), flat.shape[0], k, n, threads or torch.get_num_threads())
        return y.view(*x.shape[:-1], n)


_built: dict[str, RowsGemm] = {}  # the kernel of each precision, built or loaded once per process


def rows_gemm(directory: Path, precision: str = "float32") -> RowsGemm:
    """The kernel of ``precision`` built (or loaded) in ``directory``, once per process."""
    if precision not in _built:
        _built[precision] = RowsGemm.build(directory, precision=precision)
    return _built[precision]
