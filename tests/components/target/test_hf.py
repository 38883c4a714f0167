import pytest
import torch
from transformers import AutoModelForCausalLM

from components.config import TargetConfig
from components.target import TargetError, load_target
from components.target.hf import check_tokenizer_matches


def test_captured_layers_follow_the_hidden_states_convention(tiny_target):
    ids = torch.randint(5, tiny_target.vocab_size, (2, 12))
    out = tiny_target.forward(ids, layer_ids=[0, 2])
    ref = tiny_target.model(input_ids=ids, output_hidden_states=True)
    assert out.hidden.shape == (2, 12, 2, tiny_target.hidden_size)
    torch.testing.assert_close(out.hidden[:, :, 0], ref.hidden_states[1])
    torch.testing.assert_close(out.hidden[:, :, 1], ref.hidden_states[3])
    # the last layer is captured before the final norm; the shared head recomputes the logits
    torch.testing.assert_close(tiny_target.compute_logits(out.last_hidden), out.logits)
    assert not torch.allclose(out.last_hidden, ref.hidden_states[-1])


def test_incremental_forward_with_cache_matches_full_forward(tiny_target):
    ids = torch.randint(5, tiny_target.vocab_size, (1, 10))
    full = tiny_target.forward(ids, layer_ids=[1])
    first = tiny_target.forward(ids[:, :7], layer_ids=[1], use_cache=True)
    rest = tiny_target.forward(ids[:, 7:], layer_ids=[1], cache=first.cache)
    assert rest.cache is not None and full.cache is None
    torch.testing.assert_close(rest.logits, full.logits[:, 7:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest.hidden, full.hidden[:, 7:], atol=1e-5, rtol=1e-5)


def test_accessors(tiny_target):
    assert tiny_target.num_layers == 4
    assert tiny_target.embed(torch.tensor([[1, 2]])).shape == (1, 2, tiny_target.hidden_size)
    assert tiny_target.lm_head.weight.shape[0] == tiny_target.vocab_size
    assert not any(p.requires_grad for p in tiny_target.model.parameters())


def test_out_of_range_layer_ids_are_refused(tiny_target):
    with pytest.raises(TargetError, match=r"layer ids \[4\] out of range .*valid ids are 0..3"):
        tiny_target.forward(torch.tensor([[1, 2]]), layer_ids=[1, 4])


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(TargetError, match="is not a model directory"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "missing")))


def test_unknown_hub_id_offline_is_a_clear_error():
    with pytest.raises(TargetError, match="cannot load 'nobody-here/no-such-model'"):
        load_target(TargetConfig(name_or_path="nobody-here/no-such-model"))


def test_bad_dtype_is_a_clear_error(tiny_target_build):
    path, _ = tiny_target_build
    with pytest.raises(TargetError, match="target.dtype: 'float8'"):
        load_target(TargetConfig(name_or_path=str(path), dtype="float8"))


def test_tokenizer_that_does_not_fit_the_model_is_refused(tiny_target_build, tiny_target):
    path, _ = tiny_target_build
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(100)
    with pytest.raises(TargetError, match=r"tokenizer has \d+ tokens but the model's embedding table has 100 rows"):
        check_tokenizer_matches(model, tiny_target.tokenizer, "x")


def test_saved_checkpoint_loads_as_an_ordinary_hf_model(tiny_target_build, tiny_target):
    path, _ = tiny_target_build
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 20, 30, 40]])
    torch.testing.assert_close(model(input_ids=ids).logits, tiny_target.forward(ids).logits)
    assert model.config.tie_word_embeddings is False
