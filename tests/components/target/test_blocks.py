"""The checkpoint's own blocks in the fast step (``components.target.blocks``, the kernel's
``rows_gemm_blocks.c``): read from a GGUF file as gguf's own reference decodes them, found again
from float32 weights (permuted, stacked) only where they decode bit for bit, their products
equal to the float32 kernel's, and greedy decoding through a step that reads them token for
token the target's own (float32), plain and speculative."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from components.engine import SpeculativeEngine, SuffixDrafter, target_only_generate
from components.target import kernels
from components.target.blocks import (
    BlockIndex,
    Blocks,
    gguf_tensors,
    pack_panels,
    quantize_q8_0,
    read_gguf,
)
from components.target.fast import MAX_KERNEL_ROWS, StepTarget, step_target
from components.target.hf import TargetError
from components.target.kernels import (
    BLOCK_ROWS,
    Q41_DECODES,
    KernelUnavailable,
    RowsGemm,
    isas,
    q41_decode,
    why_unavailable,
)
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter

gguf = pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(why_unavailable() is not None, reason=f"kernel: {why_unavailable()}")
KINDS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str | None]], metadata: bool = False) -> Path:
    """A GGUF file of ``name: (float32 array, format or None)``; quantized by gguf's own code;
    ``metadata``: with fields of every kind a checkpoint carries (strings, arrays of strings and
    numbers, a non-default alignment) before the tensor table."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if metadata:
        writer.add_custom_alignment(64)
        writer.add_string("general.name", "tiny ✓")
        writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "ü" * 40])
        writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 0.0])
        writer.add_uint32("llama.block_count", 2)
        writer.add_bool("general.flag", True)
    for name, (w, fmt) in tensors.items():
        if fmt is None:
            writer.add_tensor(name, w.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), KINDS[fmt]), raw_dtype=KINDS[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_stored(w: np.ndarray, fmt: str) -> torch.Tensor:
    """The float32 weight a checkpoint of ``fmt`` blocks holds for ``w`` (gguf's reference)."""
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), KINDS[fmt]), KINDS[fmt]))


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((40, 64)), "b": rng.standard_normal((24, 64)), "c": rng.standard_normal((8, 96)),
            "e": np.where(rng.random((50, 64)) < 0.9, 0.0, rng.standard_normal((50, 64)))}  # rows alike but for a few


@pytest.fixture(scope="module")
def index(tmp_path_factory, weights) -> BlockIndex:
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "w.gguf", {
        "a": (weights["a"], "q4_1"), "b": (weights["b"], "q4_1"), "c": (weights["c"], "q4_1"),
        "e": (weights["e"], "q8_0"), "f": (weights["a"][:4], None)})
    return BlockIndex.from_gguf(path)


def test_read_gguf_decodes_as_ggufs_reference(tmp_path, weights):
    path = write_gguf(tmp_path / "w.gguf", {"a": (weights["a"], "q4_1"), "e": (weights["e"], "q8_0"),
                                            "f": (weights["a"], None)}, metadata=True)
    table = {name: (kind, shape, raw) for name, kind, shape, raw in gguf_tensors(path)}
    for tensor in gguf.GGUFReader(str(path)).tensors:  # the tensor table as gguf's own reader sees it
        kind, shape, raw = table[tensor.name]
        assert shape == tuple(int(v) for v in tensor.shape[::-1])
        if tensor.tensor_type.name in ("Q4_1", "Q8_0"):
            assert kind == tensor.tensor_type.name and np.array_equal(raw.reshape(-1), np.asarray(tensor.data).reshape(-1))
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(28))
    with pytest.raises(ValueError, match="not.gguf: not a GGUF file"):
        list(gguf_tensors(tmp_path / "not.gguf"))
    read = list(read_gguf(path))
    assert [b.format for b in read] == ["q4_1", "q8_0"]  # the float32 tensor is not blocks
    assert torch.equal(read[0].dequantize(), as_stored(weights["a"], "q4_1"))
    assert torch.equal(read[1].dequantize(), as_stored(weights["e"], "q8_0"))
    cols = torch.tensor([0, 5, 33, 63])
    assert torch.equal(read[0].columns(cols), read[0].dequantize()[:, cols])


def test_find_permuted_and_stacked_rows_bit_for_bit(index, weights):
    a, b = as_stored(weights["a"], "q4_1"), as_stored(weights["b"], "q4_1")
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    for w in (a, a[perm], torch.cat([b, a[:7]]), as_stored(weights["c"], "q4_1")):
        found = index.find(w)
        assert found is not None and found.format == "q4_1" and torch.equal(found.dequantize(), w)
    e = as_stored(weights["e"], "q8_0")  # mostly-zero rows: fingerprints alike, told apart whole
    found = index.find(e.flip(0))
    assert found is not None and found.format == "q8_0" and torch.equal(found.dequantize(), e.flip(0))


def test_find_refuses_what_it_cannot_reproduce(index, weights):
    a = as_stored(weights["a"], "q4_1")
    flipped = a.clone()
    flipped.view(torch.int32)[3, 17] ^= 1  # one bit of one weight
    assert index.find(flipped) is None
    assert index.find(torch.from_numpy(weights["a"]).float()) is None  # the unquantized values
    assert index.find(torch.cat([a[:2], as_stored(weights["e"], "q8_0")[:2]])) is None  # two formats in one weight
    assert index.find(a.double()) is None and index.find(a[:, :48]) is None


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """One directory for this module's builds: each build (ISA, decoding) is compiled once."""
    return tmp_path_factory.mktemp("kernels")


@needs_kernel
@pytest.mark.parametrize("isa, q41, fmt", [(isa, q41, fmt) for isa in isas() for q41 in Q41_DECODES for fmt in ("q4_1", "q8_0")
                                           if (isa == "avx512" or q41 == "convert")
                                           and (isa != "amx" or fmt == "q4_1")])  # AMX's Q8_0: AVX-512's
@pytest.mark.parametrize("k", [64, 96])
def test_block_products_equal_the_float32_kernels(kernel_dir, isa, q41, fmt, k):
    """With the decoded weights: bit for bit where the tiles sum in the float32 kernel's order
    (AVX2: 1 and 4..6 rows; AVX-512: every row count, either Q4_1 decoding), else within float32
    rounding (AMX, Q4_1: up to 12 rows the AVX-512 tiles, bit for bit; more on the tile unit, where
    a row's bits do not depend on the rows beside it); 45 and 77 weight rows (not multiples of 16)."""
    kernel = RowsGemm.build(kernel_dir, isa, q41)
    assert kernel.q41 == q41
    amx_tiles = isa == "amx"
    same_order = range(1, 13) if amx_tiles else range(1, 18) if isa == "avx512" else (1, 4, 5, 6)
    gen = torch.Generator().manual_seed(k)
    for n in (45, 77):
        w = as_stored(torch.randn(n, k, generator=gen).numpy(), fmt)
        blocks = BlockIndex([_blocks_of(w, fmt)]).find(w)
        assert blocks is not None
        packed, plain = kernel.pack_blocks(blocks, w), kernel.pack(w)
        assert packed.format == fmt and packed.panels.dtype == torch.uint8
        assert packed.dense.format == "f32" if isa == "avx2" else packed.dense is None  # AVX-512: blocks at any rows
        assert packed.panels.shape == ((n + 15) // 16, k // 32, 384 if fmt == "q4_1" else 576)
        only_blocks = dataclasses.replace(packed, dense=None)  # every row count through the blocks kernel
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
            x = torch.randn(rows, k, generator=gen)
            for threads in (1, 2):
                got, want = kernel.linear(x, only_blocks, threads), kernel.linear(x, plain, threads)
                if rows in same_order:
                    assert torch.equal(got, want), (rows, threads)
                torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)
                if amx_tiles and rows > 13:  # on the tile unit: the first 13 rows' bits as in a pass of 13
                    assert torch.equal(got[:13], kernel.linear(x[:13], only_blocks, threads))
                if rows > BLOCK_ROWS and packed.dense is not None:  # AVX2's longer passes read the float32 panels
                    assert torch.equal(kernel.linear(x, packed, threads), want)


@pytest.mark.skipif("amx" not in isas(), reason="the CPU declares no AMX tiles")
def test_amx_block_products_carry_float32_arithmetic(kernel_dir):
    """Three bfloat16 pieces of each input and Q4_1's integers through the tile unit: the error
    against a float64 product is float32's (under 1e-6 of sum |x w|; a lost piece is 1e-5), no
    larger than the AVX-512 kernel's, at 13..40 rows (blocks of 16 and the rest)."""
    amx, avx512 = RowsGemm.build(kernel_dir, "amx"), RowsGemm.build(kernel_dir, "avx512")
    gen = torch.Generator().manual_seed(3)
    w = as_stored(torch.randn(70, 256, generator=gen).numpy(), "q4_1")
    blocks = BlockIndex([_blocks_of(w, "q4_1")]).find(w)
    for rows in (13, 16, 40):
        x = torch.randn(rows, 256, generator=gen) * torch.logspace(-3, 3, 256)[torch.randperm(256, generator=gen)]
        exact, scale = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
        errors = [float(((k.linear(x, k.pack_blocks(blocks, w), 2).double() - exact).abs() / scale).max())
                  for k in (amx, avx512)]
        assert errors[0] < 1e-6 and errors[0] <= 2 * errors[1], (rows, errors)


@pytest.mark.skipif("amx" not in isas(), reason="the CPU declares no AMX tiles")
def test_the_default_build_is_avx512_where_the_os_refuses_amx_tiles(kernel_dir, monkeypatch):
    assert RowsGemm.build(kernel_dir).isa == "amx"
    monkeypatch.setattr(kernels, "request_amx", lambda: False)
    assert RowsGemm.build(kernel_dir).isa == "avx512"
    with pytest.raises(KernelUnavailable, match="AMX tiles"):
        RowsGemm.build(kernel_dir, "amx")


@needs_kernel
def test_q41_decoding_is_chosen_by_the_declared_cpu(tmp_path):
    """The AVX2 build has one Q4_1 decoding; asking it for another is a clear error."""
    assert q41_decode("avx2") == "convert" and q41_decode("avx512") in Q41_DECODES
    with pytest.raises(ValueError, match="AVX-512 only"):
        RowsGemm.build(tmp_path, "avx2", "permute")


def test_quantize_q8_0_rounds_each_weight_to_its_blocks_grid(weights):
    """Every weight within half a step (d / 2) of its decoded value, the block's largest exact;
    an all-zero block decodes to zeros; as close to the weight as gguf's own Q8_0."""
    w = torch.from_numpy(weights["e"]).float()  # blocks of zeros among the others
    blocks = quantize_q8_0(w)
    assert blocks.format == "q8_0" and blocks.q.dtype == torch.int8 and blocks.d.shape == (50, 2)
    err = (blocks.dequantize() - w).abs().view(50, 2, 32)
    assert bool((err <= blocks.d[..., None] / 2 * (1 + 1e-5)).all())
    top = w.abs().view(50, 2, 32).argmax(-1, keepdim=True)
    assert float(err.gather(-1, top).max()) <= 1e-6
    assert bool((blocks.dequantize()[w == 0] == 0).all())
    ref = (as_stored(weights["e"], "q8_0") - w).abs().max()
    assert float(err.max()) <= float(ref) * 1.01
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(w[:, :40])


def _blocks_of(w: torch.Tensor, fmt: str) -> Blocks:
    """Blocks that decode to ``w`` (already a stored weight), recovered through a GGUF round trip."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "one.gguf", {"w": (w.numpy(), fmt)})
        (blocks,) = read_gguf(path)
    return blocks


def test_pack_panels_layout():
    """Record of panel 0, block 0: d[16] (then m[16]), then per k the 16 rows' q."""
    q = torch.arange(20 * 32, dtype=torch.int64).remainder(16).view(20, 32).to(torch.uint8)
    d, m = torch.arange(20, dtype=torch.float32)[:, None], -torch.ones(20, 1)
    out = pack_panels(Blocks("q4_1", q, d, m))
    assert out.shape == (2, 1, 384)
    assert out[0, 0, :64].view(torch.float32).tolist() == list(range(16))
    assert out[0, 0, 64:128].view(torch.float32).tolist() == [-1.0] * 16
    nib = out[0, 0, 128:136]  # k = 0: byte j = q[j, 0] | q[j + 8, 0] << 4
    assert nib.tolist() == [int(q[j, 0]) | int(q[j + 8, 0]) << 4 for j in range(8)]
    assert out[1, 0, 16:64].view(torch.float32).tolist() == [0.0] * 12  # rows past N: zero
    words = pack_panels(Blocks("q4_1", q, d, m), nibbles="words")  # per 8 k, word j: row j's q, first k lowest
    assert torch.equal(words[..., :128], out[..., :128])
    for group in range(4):
        got = words[0, 0, 128 + 64 * group:192 + 64 * group].view(torch.int32).tolist()
        assert got == [sum(int(q[j, 8 * group + i]) << 4 * i for i in range(8)) - (1 << 32) * (q[j, 8 * group + 7] >= 8)
                       for j in range(16)]
    tiles = pack_panels(Blocks("q4_1", q, d, m), nibbles="amx")  # tile row r, element 2j + t = q[j, 2r + t]
    assert torch.equal(tiles[..., :128], out[..., :128])
    line = tiles[0, 0, 128 + 32 * 3:160 + 32 * 3]  # line 3: tile rows 6 (low nibbles) and 7 (high)
    assert line.tolist() == [int(q[i // 2, 12 + i % 2]) | int(q[i // 2, 14 + i % 2]) << 4 for i in range(32)]
    with pytest.raises(ValueError, match="nibbles"):
        pack_panels(Blocks("q4_1", q, d, m), nibbles="bytes")


@pytest.fixture(scope="module")
def stored_target(tiny_target_cfg, tmp_path_factory):
    """The fixture target with every decoder product stored as Q4_1 and the head as Q8_0: its
    float32 weights replaced by what such a checkpoint holds, the GGUF declared as its source."""
    from components.target import load_target

    target = load_target(tiny_target_cfg, progress=False)
    tensors = {}
    for name, param in target.model.named_parameters():
        if param.dim() == 2:
            fmt = "q8_0" if param.shape[0] == target.vocab_size else "q4_1"
            param.data.copy_(as_stored(param.detach().numpy(), fmt))
            tensors[name] = (param.detach().numpy(), fmt)
    target.block_source = write_gguf(tmp_path_factory.mktemp("stored") / "target.gguf", tensors)
    return target


@needs_kernel
def test_a_step_reading_blocks_decodes_as_the_target(tiny_target_cfg, stored_target, tmp_path):
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=256, cache_dir=str(tmp_path))
    lines: list[str] = []
    taps = tuple(range(stored_target.num_layers))
    fast = step_target(stored_target, cfg, taps=taps, lines=lines.append)
    assert isinstance(fast, StepTarget) and fast.weight_formats == ("q4_1", "q8_0")
    assert "q4_1 blocks" in lines[0] and "q4_1/q8_0 blocks" in fast.forward_kind
    plain = step_target(stored_target, dataclasses.replace(cfg, step_weights="float32"), taps=taps)
    assert plain.weight_formats == ("f32",) and "blocks" not in plain.forward_kind
    ids = torch.tensor([prompts(stored_target)[0] * 8], dtype=torch.long)[:, :48]
    out, ref = fast.forward(ids[:, :24], use_cache=True), plain.forward(ids[:, :24], use_cache=True)
    for count in (1, 3, 6, 16, 24):  # verify passes (and wide ones: AMX tiles where declared), as float32's
        got = fast.forward(ids[:, 24:24 + count], cache=out.cache, use_cache=True).logits
        want = plain.forward(ids[:, 24:24 + count], cache=ref.cache, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        out.cache.crop(24), ref.cache.crop(24)
    drafters = [random_drafter(stored_target, "dspark"), SuffixDrafter(stored_target.vocab_size, 8)]
    for prompt in [*prompts(stored_target), prompts(stored_target)[2] * 3]:  # the last one's prefill is wide
        want = target_only_generate(stored_target, prompt, MAX_NEW).tokens  # the transformers forward
        assert target_only_generate(fast, prompt, MAX_NEW).tokens == want
        for drafter in drafters:
            engine = SpeculativeEngine(fast, drafter, rule="greedy", num_speculative_tokens=4)
            assert engine.generate(prompt, MAX_NEW).tokens == want


@needs_kernel
def test_a_verify_pass_of_many_rows_reads_the_heads_blocks(tiny_target_cfg, stored_target, tmp_path, monkeypatch):
    """Past the rows where the step's products go to torch's float32 GEMM (a prompt's), a pass's
    head still reads the head's Q8_0 blocks through the kernel, as its layers do (a batch
    round's verify rows), and its logits are the float32 step's."""
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=256, cache_dir=str(tmp_path))
    fast = step_target(stored_target, cfg)
    plain = step_target(stored_target, dataclasses.replace(cfg, step_weights="float32"))
    ids = torch.tensor([prompts(stored_target)[0] * 8], dtype=torch.long)[:, :8 + MAX_KERNEL_ROWS + 8]
    out, ref = fast.forward(ids[:, :8], use_cache=True), plain.forward(ids[:, :8], use_cache=True)
    rows: list[int] = []
    kernel_linear = fast.decoder.kernels.linear
    monkeypatch.setattr(fast.decoder.kernels, "linear", lambda x, w, *a: rows.append(x.shape[0]) or kernel_linear(x, w, *a))
    got = fast.forward(ids[:, 8:], cache=out.cache, use_cache=True).logits
    assert rows and max(rows) == MAX_KERNEL_ROWS + 8  # the head's rows, in one product over its blocks
    want = plain.forward(ids[:, 8:], cache=ref.cache, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_step_weights_setting(tiny_target_cfg, tiny_target, stored_target, tmp_path):
    from components.target.fast import block_index

    index, why = block_index(tiny_target, tiny_target_cfg)
    assert index is None and why.endswith("stores its weights unquantized")
    assert block_index(stored_target, dataclasses.replace(tiny_target_cfg, step_weights="float32"))[0] is None
    with pytest.raises(TargetError, match="target.step_weights: 'int4'"):
        block_index(stored_target, dataclasses.replace(tiny_target_cfg, step_weights="int4"))
