"""The target's weights in the block-quantized format its checkpoint stores them in.

SmolLM2-135M-Instruct comes as a GGUF file of Q4_1 blocks (its 210 decoder products) and Q8_0
blocks (the tied embedding / head); the float32 target specline converts it to holds, in every
weight, exactly d * q + m of a block of 32 (docs/results.md). A decode step must read every
weight; read as blocks it reads 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4, and
decoding them in the kernel (``kernels/rows_gemm_blocks.c``) gives back the float32 weight
exactly. So the fast step may read the blocks, and nothing about the target changes.

    index = BlockIndex.from_gguf(path)          # every Q4_1 / Q8_0 tensor of the file
    blocks = index.find(w)                      # w [N, K] float32 → Blocks, or None
    panels = pack_panels(blocks)                # uint8, the kernel's layout

``find`` matches a float32 weight row by row (a fingerprint of some of each row's bits, so a weight that
is a permutation or a concatenation of the file's rows is found too: transformers permutes q/k
rows for RoPE, the fast step stacks q/k/v and gate/up) and returns blocks only where decoding
them reproduces ``w`` bit for bit; anything else is None, and the caller keeps float32. Knows
GGUF's Q4_1 and Q8_0 block layouts; nothing of models or kernels beyond the panel layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

BLOCK = 32  # weights per block along K (both formats)
PANEL = 16  # weight rows per packed panel (NR in the kernels)
RECORD_BYTES = {"q4_1": 384, "q8_0": 576}  # one panel's 32-k record (rows_gemm_blocks.c)
GGUF_BYTES = {"Q4_1": 20, "Q8_0": 34}  # one block of 32 in the file


@dataclass(frozen=True)
class Blocks:
    """Rows of a block-quantized weight [N, K]: w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32].
    ``q``: uint8 0..15 (q4_1) or int8 (q8_0), [N, K]; ``d``, ``m``: float32 [N, K // 32] (the
    file's float16 values; ``m`` None for q8_0)."""

    format: str
    q: Tensor
    d: Tensor
    m: Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, index: Tensor) -> Blocks:
        return Blocks(self.format, self.q[index], self.d[index], None if self.m is None else self.m[index])

    def dequantize(self) -> Tensor:  # [N, K] float32, as the conversion to float32 computed it
        n, k = self.shape
        w = self.q.view(n, k // BLOCK, BLOCK).to(torch.float32) * self.d[..., None]  # exact: 11 × 4 or 8 bits
        return (w if self.m is None else w + self.m[..., None]).view(n, k)

    def columns(self, cols: Tensor) -> Tensor:  # [N, len(cols)] float32: dequantize()[:, cols]
        w = self.q[:, cols].to(torch.float32) * self.d[:, cols // BLOCK]
        return w if self.m is None else w + self.m[:, cols // BLOCK]


def quantize_q8_0(w: Tensor) -> Blocks:
    """A float32 weight [N, K] (K a multiple of 32) as Q8_0 blocks: per block of 32 along K, the
    scale d = max |w| / 127 and q = round(w / d) (int8), as llama.cpp quantizes. Lossy (about
    0.4% of a block's largest weight): for weights whose products need not be exact (a drafter's)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"quantize_q8_0: K = {k} is not a multiple of {BLOCK}")
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0  # [N, K/32]
    q = torch.where(d[..., None] > 0, blocks / d.clamp_min(torch.finfo(torch.float32).tiny)[..., None], 0.0)
    return Blocks("q8_0", q.round().clamp(-127, 127).to(torch.int8).view(n, k), d.contiguous(), None)


GGML_TYPES = {3: "Q4_1", 8: "Q8_0"}  # ggml's type ids of the block formats (others: not blocks here)
_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


def gguf_tensors(path: Path) -> Iterable[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """(name, ggml type name or its id, shape [rows, ..., innermost], raw bytes [rows, row bytes] uint8)
    of every tensor in a GGUF file (version 2 or 3); the bytes (of block formats only; empty for
    other types) are a read-only view of the mapped file.
    Reads the header's tensor table itself: gguf's reader also decodes every metadata field
    (the tokenizer's ~100 K strings), seconds a start that this index does not need."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def take(fmt: str, count: int = 1) -> np.ndarray:
        nonlocal pos
        out = np.frombuffer(data, dtype=fmt, count=count, offset=pos)
        pos += out.nbytes
        return out

    def string() -> str:
        nonlocal pos
        size = int(take("<u8")[0])
        pos += size
        return bytes(data[pos - size:pos]).decode("utf-8", errors="replace")

    def skip(kind: int) -> int | float | None:  # a metadata value; returns scalars (the alignment)
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = int(take("<u4")[0]), int(take("<u8")[0])
            if inner in _SCALAR:
                pos += np.dtype(_SCALAR[inner]).itemsize * count
            else:
                for _ in range(count):
                    skip(inner)
        elif kind in _SCALAR:
            return take(_SCALAR[kind])[0].item()
        else:
            raise ValueError(f"{path}: metadata value type {kind} is not GGUF's")
        return None

    if bytes(data[:4]) != b"GGUF" or int(take("<u4", 2)[1]) not in (2, 3):
        raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
    count, fields = (int(v) for v in take("<u8", 2))
    alignment = 32
    for _ in range(fields):
        key, kind = string(), int(take("<u4")[0])
        value = skip(kind)
        if key == "general.alignment":
            alignment = int(value)
    table = []
    for _ in range(count):
        name, dims = string(), int(take("<u4")[0])
        shape = tuple(int(v) for v in take("<u8", dims))[::-1]  # GGUF lists the innermost dimension first
        kind, offset = int(take("<u4")[0]), int(take("<u8")[0])
        table.append((name, GGML_TYPES.get(kind, str(kind)), shape, offset))
    start = -(-pos // alignment) * alignment
    for name, kind, shape, offset in table:
        rows, inner = int(np.prod(shape[:-1])), shape[-1]
        row_bytes = inner // BLOCK * GGUF_BYTES[kind] if kind in GGUF_BYTES else 0
        yield name, kind, shape, data[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)


def read_gguf(path: Path) -> Iterable[Blocks]:
    """Every Q4_1 / Q8_0 tensor of a GGUF file, as ``Blocks`` [rows, K] (other types skipped)."""
    for _, kind, _, table in gguf_tensors(path):
        if kind not in GGUF_BYTES:
            continue
        raw = torch.from_numpy(np.array(table))  # a copy: the file stays read-only  # [rows, K/32 * bytes] uint8
        b = raw.view(raw.shape[0], -1, GGUF_BYTES[kind])  # [rows, G, bytes]
        d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [rows, G]
        if kind == "Q4_1":
            m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
            packed = b[..., 4:]  # [rows, G, 16]: byte i = q[i] | q[i + 16] << 4
            q = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(raw.shape[0], -1)
            yield Blocks("q4_1", q.contiguous(), d, m)
        else:
            q = b[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
            yield Blocks("q8_0", q, d, None)


SAMPLED = 24  # columns a row's fingerprint reads


def sampled_columns(k: int) -> Tensor:
    """The columns fingerprints read for rows of K columns: spread over the row, fixed per K."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(k))[:SAMPLED].sort().values


def fingerprints(values: Tensor) -> list[int]:
    """A hash of each row's float32 bits at ``sampled_columns`` (``values`` [N, SAMPLED]:
    those columns; integer arithmetic, so the same bits give the same hash whatever the row's
    neighbours), for finding rows again, never for proving them equal."""
    weights = torch.randint(1, 1 << 16, (values.shape[1],), generator=torch.Generator().manual_seed(1),
                            dtype=torch.int64)
    bits = values.contiguous().view(torch.int32).to(torch.int64)  # |sum| < 2^31 · 2^16 · 24: no overflow
    return (bits * weights).sum(dim=1).tolist()


class BlockIndex:
    """Rows of block-quantized tensors, found again from their float32 values (``find``)."""

    def __init__(self, tensors: Iterable[Blocks]):
        groups: dict[tuple[str, int], list[Blocks]] = {}
        for blocks in tensors:
            groups.setdefault((blocks.format, blocks.shape[1]), []).append(blocks)
        self.groups: dict[tuple[str, int], Blocks] = {}
        # K → {fingerprint: [(format, row in its group), ...]} (rows alike in the sampled columns,
        # e.g. mostly-zero embedding rows, share a fingerprint: ``find`` compares them whole)
        self.rows: dict[int, dict[int, list[tuple[str, int]]]] = {}
        for (fmt, k), parts in groups.items():
            whole = Blocks(fmt, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                           None if parts[0].m is None else torch.cat([p.m for p in parts]))
            self.groups[(fmt, k)] = whole
            table = self.rows.setdefault(k, {})
            for i, fp in enumerate(fingerprints(whole.columns(sampled_columns(k)))):
                table.setdefault(fp, []).append((fmt, i))

    @classmethod
    def from_gguf(cls, path: Path) -> BlockIndex:
        return cls(read_gguf(path))

    def find(self, w: Tensor) -> Blocks | None:
        """The blocks of the float32 weight ``w`` [N, K], if every row is one of the index's rows
        (all of one format) and decoding them gives ``w`` bit for bit; else None."""
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK:
            return None
        k = w.shape[1]
        table = self.rows.get(k, {})
        found = [table.get(fp) for fp in fingerprints(w[:, sampled_columns(k)])]
        if not found or any(f is None for f in found):
            return None
        picked = [f[0] if len(f) == 1 else self._whole_match(w[n], f) for n, f in enumerate(found)]
        if any(p is None for p in picked) or len({p[0] for p in picked}) != 1:
            return None
        blocks = self.groups[(picked[0][0], k)].rows(torch.tensor([p[1] for p in picked]))
        return blocks if torch.equal(blocks.dequantize(), w) else None

    def _whole_match(self, row: Tensor, candidates: list[tuple[str, int]]) -> tuple[str, int] | None:
        """The candidate whose whole row decodes to ``row`` [K] (fingerprints alike)."""
        for fmt, i in candidates:
            if torch.equal(self.groups[(fmt, row.shape[0])].rows(torch.tensor([i])).dequantize()[0], row):
                return fmt, i
        return None


NIBBLES = ("rows", "words", "amx")  # how a record lays out its q (the kernel declares which it reads)


def pack_panels(blocks: Blocks, nibbles: str = "rows") -> Tensor:
    """``blocks`` [N, K] in the kernel's layout: panels of 16 rows (rows past N zero), each a
    record per 32 k: float32 d[16] (then m[16] for q4_1), then the 32 k's q: q8_0 16 bytes a k;
    q4_1 256 bytes, ``nibbles`` "rows" (rows_gemm_blocks.c) 8 bytes a k (byte j = q[row j] |
    q[row j + 8] << 4), "words" (rows_gemm_512.c) 64 bytes a group of 8 k (32-bit word j =
    q[row j] of those k, 4 bits each, the first k lowest), "amx" (rows_gemm_amx.c) the q as the
    tile unit pairs them (tile row r = 32 values, element 2j + t = q[row j][2r + t]) in 8 lines of
    32 bytes, byte i of line l = element i of tile row 2l | element i of tile row 2l + 1 << 4.
    → uint8 [ceil(N/16), K/32, record bytes]."""
    if nibbles not in NIBBLES:
        raise ValueError(f"pack_panels: nibbles '{nibbles}' is not one of {list(NIBBLES)}")
    n, k = blocks.shape
    panels, groups, pad = -(-n // PANEL), k // BLOCK, -n % PANEL

    def per_record(t: Tensor) -> Tensor:  # [N, G] → [P, G, 16]
        return torch.nn.functional.pad(t, (0, 0, 0, pad)).view(panels, PANEL, groups).permute(0, 2, 1).contiguous()

    q = torch.nn.functional.pad(blocks.q, (0, 0, 0, pad)).view(panels, PANEL, groups, BLOCK).permute(0, 2, 3, 1)
    parts = [per_record(blocks.d).view(torch.uint8)]  # [P, G, 64]
    if blocks.format == "q4_1":
        parts.append(per_record(blocks.m).view(torch.uint8))
        if nibbles == "amx":  # [P, G, 32 k, 16 rows] → tile rows [P, G, 16, 32]: (k pair, row, k of the pair)
            tiles = q.reshape(panels, groups, PANEL, 2, PANEL).permute(0, 1, 2, 4, 3).reshape(panels, groups, PANEL, 32)
            packed = tiles[:, :, 0::2] | (tiles[:, :, 1::2] << 4)  # [P, G, 8 lines, 32]
        elif nibbles == "rows":
            packed = q[..., :PANEL // 2] | (q[..., PANEL // 2:] << 4)  # [P, G, 32, 8]
        else:  # [P, G, 4 groups, 16 rows, 4 bytes]: byte b of word j = q[j][2b] | q[j][2b + 1] << 4
            per_row = q.reshape(panels, groups, 4, 8, PANEL).transpose(3, 4)  # [P, G, 4, 16, 8]
            packed = per_row[..., 0::2] | (per_row[..., 1::2] << 4)
        parts.append(packed.contiguous().view(panels, groups, BLOCK * PANEL // 2))
    else:
        parts.append(q.contiguous().view(torch.uint8).view(panels, groups, BLOCK * PANEL))
    out = torch.cat(parts, dim=-1).contiguous()
    assert out.shape[-1] == RECORD_BYTES[blocks.format]
    return out
