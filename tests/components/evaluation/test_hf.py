"""transformers' generate as a peer: exact greedy tokens, no stop tokens, rounds read off passes."""

from __future__ import annotations

from components.engine import target_only_generate
from components.evaluation.hf import Pass, hf_generate, rounds_from_passes

NEW = 16


def test_rounds_from_passes_reconstructs_accepted_and_drafted():
    # prompt of 5: pass 0 = prompt + 3 drafts (2 accepted → 3 emitted, committed 5 → 8);
    # pass 1 at position 7 = last token + 4 drafts (0 accepted → 1 emitted); pass 2 no drafts.
    passes = [Pass(8, 0), Pass(5, 7), Pass(1, 8)]
    accepted, drafted = rounds_from_passes(passes, prompt_len=5, final_len=5 + 3 + 1 + 1)
    assert accepted == [2, 0, 0] and drafted == [3, 4, 0]
    assert rounds_from_passes([Pass(8, None)], 5, 10) is None  # positions unknown: unmeasured


def test_hf_generate_equals_our_greedy_decoding(tiny_target, eval_prompt_list):
    prompt = list(eval_prompt_list[0].input_ids)
    ref = target_only_generate(tiny_target, prompt, NEW).tokens
    plain = hf_generate(tiny_target.model, prompt, NEW)
    assert plain.tokens == ref and plain.target_forwards == NEW and plain.accepted == []


def test_hf_prompt_lookup_rounds_add_up(tiny_target, eval_prompt_list):
    prompt = list(eval_prompt_list[0].input_ids)
    ref = target_only_generate(tiny_target, prompt, NEW).tokens
    run = hf_generate(tiny_target.model, prompt, NEW, method="hf_prompt_lookup",
                      prompt_lookup_num_tokens=4, max_matching_ngram_size=2)
    assert run.tokens == ref
    assert run.rounds == run.target_forwards  # every target pass is a verify round
    assert sum(run.accepted) + run.rounds == NEW  # each round emits accepted + 1 tokens
    assert all(0 <= a <= d <= 4 for a, d in zip(run.accepted, run.drafted))


def test_stop_tokens_of_the_model_do_not_end_generation(tiny_target, eval_prompt_list, monkeypatch):
    """generate fills unset fields from the model's generation config: a stop token there must not
    cut the output short (our engine has no stop tokens; both must give exactly NEW tokens)."""
    prompt = list(eval_prompt_list[0].input_ids)
    ref = target_only_generate(tiny_target, prompt, NEW).tokens
    monkeypatch.setattr(tiny_target.model.generation_config, "eos_token_id", [ref[3]])
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", ref[3])
    assert hf_generate(tiny_target.model, prompt, NEW).tokens == ref
    run = hf_generate(tiny_target.model, prompt, NEW, prompt_lookup_num_tokens=4)
    assert run.tokens == ref
