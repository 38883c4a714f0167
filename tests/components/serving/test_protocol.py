"""Request checks: every client mistake is a 400 (404 for another model) naming the field;
supported fields come out as typed generation parameters; unsupported ones are refused unless
they carry their neutral value; vLLM's own extensions are read as vLLM defines them."""

from __future__ import annotations

import json

import pytest

from components.serving.protocol import NEUTRAL, APIError, Served, parse_json, parse_request
from components.spec.sampling import SamplingParams


@pytest.fixture(scope="module")
def served(tiny_target) -> Served:
    return Served("tiny", tiny_target.tokenizer, tiny_target.vocab_size, 64, (2,))


def _error(kind: str, body: dict, served: Served) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, body, served)
    return info.value


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [  # (kind, body, status, param)
    ("completion", {}, 400, "prompt"),
    ("completion", {"prompt": ""}, 400, "prompt"),
    ("completion", {"prompt": 5}, 400, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completion", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("completion", {"prompt": list(range(3, 70))}, 400, "prompt"),  # past the 64-token context
    ("completion", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completion", {"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
    ("completion", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("completion", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("completion", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("completion", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completion", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completion", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("completion", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completion", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completion", {"prompt": "x", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("completion", {"prompt": "x", "n": 2}, 400, "n"),
    ("completion", {"prompt": "x", "logprobs": 1}, 400, "logprobs"),
    ("completion", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("completion", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("completion", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completion", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("completion", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("completion", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"bogus": True}}, 400, "stream_options.bogus"),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400,
     "continuous_usage_stats"),
    ("completion", {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("completion", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("chat", {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}, 400, "chat_template_kwargs"),
    ("chat", {}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat", {**CHAT, "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param"), BAD)
def test_bad_requests_name_the_field(served, kind, body, status, param):
    err = _error(kind, body, served)
    assert (err.status, err.param) == (status, param), err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_malformed_json_is_a_400():
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(APIError) as info:
            parse_json(raw)
        assert info.value.status == 400


def test_fields_are_honoured(served, tiny_target):
    body = {"prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 11,
            "stop": "##", "stop_token_ids": [9], "stream": True, "stream_options": {"include_usage": True},
            "user": "u1", "n": 1, "logprobs": None, "presence_penalty": 0, "speculate": False,
            "return_token_ids": True, "model": "tiny"}
    p = parse_request("completion", json.loads(json.dumps(body)), served)
    assert (p.prompt_ids, p.max_tokens, p.sampling, p.seed) == ([5, 6, 7], 9, SamplingParams(0.7, 20, 0.9), 11)
    assert p.stop == ["##"] and p.stop_token_ids == (9, 2) and p.stream and p.include_usage
    assert not p.speculate and p.return_token_ids and p.user == "u1"
    assert parse_request("completion", {**body, "ignore_eos": True}, served).stop_token_ids == (9,)
    assert parse_request("completion", {**body, "top_k": 10**30}, served).sampling.top_k == 0  # ≥ vocabulary: off


def test_defaults_and_chat_template(served, tiny_target):
    p = parse_request("chat", {"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, served)
    expected = tiny_target.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert p.prompt_ids == list(expected)
    assert p.max_tokens == 64 - len(p.prompt_ids)  # the rest of the context, as vLLM
    assert p.sampling.temperature == 1.0 and not p.stream and 0 <= p.seed  # a random seed when none is given
    q = parse_request("completion", {"prompt": ["one prompt"], "max_tokens": 3}, served)
    assert q.prompt_ids == tiny_target.tokenizer.encode("one prompt")


VLLM_DEFAULTS = {  # vLLM's extra request fields at the values its server gives them when absent
    "use_beam_search": False, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "prompt_logprobs": None, "bad_words": [], "priority": 0,
    "return_tokens_as_token_ids": False, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "structured_outputs": None, "logits_processors": None, "request_id": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None}
VLLM_CHAT_DEFAULTS = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                      "add_special_tokens": False, "documents": None, "chat_template": None,
                      "chat_template_kwargs": None, "mm_processor_kwargs": None}


def test_vllm_extensions_at_their_defaults_are_accepted(served):
    done = parse_request("completion", {"prompt": "x", "max_tokens": 3, **VLLM_DEFAULTS, "add_special_tokens": True},
                         served)
    assert done.stop_token_ids == (2,) and done.min_tokens == 0 and done.sampling.top_k == 0
    chat = parse_request("chat", {**CHAT, "max_completion_tokens": 3, **VLLM_DEFAULTS, **VLLM_CHAT_DEFAULTS}, served)
    assert chat.max_tokens == 3
    assert set(VLLM_DEFAULTS) | set(VLLM_CHAT_DEFAULTS) <= set(NEUTRAL) | {
        "top_k", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens"}


def test_vllm_extensions_are_honoured(served, tiny_target):
    """The body a vLLM load-testing tool sends, then min_tokens and add_special_tokens."""
    body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 5, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    p = parse_request("chat", body, served)
    assert p.include_usage and p.continuous_usage and p.max_tokens == 5 and p.stop_token_ids == ()
    alone = {**body, "stream_options": {"continuous_usage_stats": True}}
    assert not parse_request("chat", alone, served).continuous_usage  # vLLM's: only with include_usage
    assert parse_request("completion", {"prompt": "x", "max_tokens": 6, "min_tokens": 4}, served).min_tokens == 4
    bare = parse_request("completion", {"prompt": "one", "add_special_tokens": False}, served)
    assert bare.prompt_ids == tiny_target.tokenizer.encode("one", add_special_tokens=False)
