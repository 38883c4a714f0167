"""Which drafter the serve stage serves: a checkpoint (``model``), suffix decoding (no
checkpoint), the hybrid of both, none, or (``auto``) what the eval stage's figures rank first;
and the serve section's checks of those keys."""

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


def _eval(drafter_path, **speedups):
    """Upstream as the train and eval stages leave it; a speedup given as a string is not lossless."""
    return {"drafter_path": drafter_path, "train_run_id": "run-1", "eval_drafter_path": drafter_path,
            "eval_speedup": {"target_only": 1.0} | {m: float(v) for m, v in speedups.items()},
            "eval_lossless": {"target_only": True} | {m: not isinstance(v, str) for m, v in speedups.items()}}


def test_auto_serves_the_fastest_lossless_form_the_eval_measured(tmp_path, checkpoint):
    cfg = _cfg(tmp_path)
    up = _eval(checkpoint, drafter_adaptive=0.87, suffix_adaptive=1.06, hybrid_adaptive=0.97, drafter=0.6)
    suffix = resolve_drafter(cfg, up, None)
    assert (suffix.method, suffix.path, suffix.label, suffix.origin) == ("suffix", None, "suffix", "serve.drafter=auto")
    assert suffix.why.startswith("the fastest in the eval stage: suffix_adaptive (suffix_adaptive 1.06×, "
                                 "hybrid_adaptive 0.97×, drafter_adaptive 0.87× of plain decoding")
    model = resolve_drafter(cfg, _eval(checkpoint, drafter_adaptive=1.3, suffix_adaptive=1.06), None)
    assert (model.method, model.path, model.label, model.origin) == ("model", checkpoint, "run-1", "train stage")
    assert "drafter_adaptive 1.30×" in model.why
    hybrid = resolve_drafter(cfg, _eval(checkpoint, drafter_adaptive=1.1, hybrid_adaptive=1.2), None)
    assert (hybrid.method, hybrid.label) == ("hybrid", "hybrid+run-1")
    # a faster figure that was not lossless is no candidate; nothing above plain decoding: none
    none = resolve_drafter(cfg, _eval(checkpoint, drafter_adaptive=0.9, suffix_adaptive="1.5"), None)
    assert (none.label, none.speculates, none.origin) == ("none", False, "serve.drafter=auto")
    assert none.why.startswith("no served form beat plain decoding") and "suffix_adaptive left out: not lossless" in none.why
    # a sampled eval does not check token equality (None): its figures count
    sampled = _eval(checkpoint, suffix_adaptive=1.2) | {"eval_lossless": {"suffix_adaptive": None}}
    assert resolve_drafter(cfg, sampled, None).method == "suffix"
    # a tie goes to the simpler form
    assert resolve_drafter(cfg, _eval(checkpoint, suffix_adaptive=1.1, drafter_adaptive=1.1), None).method == "suffix"


def test_auto_reads_the_fixed_gamma_methods_when_the_cap_is_not_adaptive(tmp_path, checkpoint):
    up = _eval(checkpoint, drafter_adaptive=0.8, suffix_adaptive=1.2, drafter=1.1, suffix=0.9)
    assert resolve_drafter(_cfg(tmp_path, adaptive=False), up, None).method == "model"
    assert resolve_drafter(_cfg(tmp_path), up, None).method == "suffix"


def test_auto_leaves_out_figures_of_another_drafter_and_serves_a_named_checkpoint(tmp_path, checkpoint):
    other = _eval(checkpoint, drafter_adaptive=1.4, suffix_adaptive=0.9) | {"eval_drafter_path": "/elsewhere"}
    pick = resolve_drafter(_cfg(tmp_path), other, None)
    assert not pick.speculates and "drafter_adaptive left out: the eval ran another drafter" in pick.why
    named = resolve_drafter(_cfg(tmp_path, drafter_path=checkpoint), _eval(checkpoint, suffix_adaptive=2.0), None)
    assert (named.method, named.path, named.origin, named.why) == ("model", checkpoint, "serve.drafter_path", "")
    # no eval figures (the serve stage alone, or an eval of other methods): the trained drafter
    assert resolve_drafter(_cfg(tmp_path), {"drafter_path": checkpoint}, None).method == "model"
    bare = _eval(checkpoint, prompt_lookup=1.3)
    assert (resolve_drafter(_cfg(tmp_path), bare, None).method, resolve_drafter(_cfg(tmp_path), bare, None).why) == \
        ("model", "")
    explicit = resolve_drafter(_cfg(tmp_path, drafter="model"), _eval(checkpoint, suffix_adaptive=2.0), None)
    assert (explicit.method, explicit.path, explicit.why) == ("model", checkpoint, "")


def test_hybrid_without_a_trained_drafter_names_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="serve.drafter=suffix for suffix decoding"):
        resolve_drafter(_cfg(tmp_path, drafter="hybrid"), {}, None)


@pytest.mark.parametrize("serve, message", [
    ({"drafter": "sufix"}, "drafter must be one of auto, model, none, suffix, hybrid"),
    ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob must be in"),
    ({"suffix_num_speculative_tokens": 64}, "suffix_max_tree_depth must exceed"),
    ({"hybrid_suffix_threshold": -1.0}, "hybrid_suffix_threshold must be"),
    ({"prefill_threads": -1}, "prefill_threads must be at least 0"),
    ({"prefix_cache_tokens": 8}, "prefix_cache_tokens must be 0 \\(off\\) or at least one block of 16 tokens"),
])
def test_serve_drafter_keys_out_of_range_are_config_errors(serve, message):
    with pytest.raises(ConfigError, match=f"serve: .*{message}"):
        ServeConfig(**serve)
