"""Which drafter the serve stage serves: a checkpoint (``auto``), suffix decoding (no
checkpoint), the hybrid of both, or none; and the serve section's checks of those keys."""

from __future__ import annotations

import pytest

from components.config import ConfigError, ServeConfig, SpeclineConfig
from components.serving.provenance import DrafterSource, resolve_drafter


def _cfg(tmp_path, **serve) -> SpeclineConfig:
    return SpeclineConfig(run_dir=str(tmp_path / "runs"), serve=ServeConfig(**serve))


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "drafter"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def test_each_served_drafter_and_its_label(tmp_path, checkpoint):
    upstream = {"drafter_path": checkpoint, "train_run_id": "run-1"}
    auto = resolve_drafter(_cfg(tmp_path), upstream, None)
    assert (auto.path, auto.method, auto.label, auto.speculates) == (checkpoint, "model", "run-1", True)
    suffix = resolve_drafter(_cfg(tmp_path, drafter="suffix"), upstream, None)
    assert (suffix.path, suffix.method, suffix.label, suffix.speculates) == (None, "suffix", "suffix", True)
    hybrid = resolve_drafter(_cfg(tmp_path, drafter="hybrid", drafter_path=checkpoint), {}, None)
    assert (hybrid.path, hybrid.method, hybrid.label) == (checkpoint, "hybrid", "hybrid+drafter")
    none = resolve_drafter(_cfg(tmp_path, drafter="none"), upstream, None)
    assert (none.label, none.speculates) == ("none", False)
    assert DrafterSource(None, "bench").label == "none"


def test_hybrid_without_a_trained_drafter_names_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="serve.drafter=suffix for suffix decoding"):
        resolve_drafter(_cfg(tmp_path, drafter="hybrid"), {}, None)


@pytest.mark.parametrize("serve, message", [
    ({"drafter": "sufix"}, "drafter must be one of auto, none, suffix, hybrid"),
    ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob must be in"),
    ({"suffix_num_speculative_tokens": 64}, "suffix_max_tree_depth must exceed"),
    ({"hybrid_suffix_threshold": -1.0}, "hybrid_suffix_threshold must be"),
])
def test_serve_drafter_keys_out_of_range_are_config_errors(serve, message):
    with pytest.raises(ConfigError, match=f"serve: .*{message}"):
        ServeConfig(**serve)
