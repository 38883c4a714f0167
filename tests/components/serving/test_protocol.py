"""Request checks: every client mistake is a 400 (404 for another model) naming the field;
supported fields come out as typed generation parameters; unsupported ones are refused unless
they carry their neutral value."""

from __future__ import annotations

import json

import pytest

from components.serving.protocol import APIError, Served, parse_json, parse_request


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
    assert (p.prompt_ids, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == ([5, 6, 7], 9, 0.7, 0.9, 20, 11)
    assert p.stop == ["##"] and p.stop_token_ids == (9, 2) and p.stream and p.include_usage
    assert not p.speculate and p.return_token_ids and p.user == "u1"
    assert parse_request("completion", {**body, "ignore_eos": True}, served).stop_token_ids == (9,)
    assert parse_request("completion", {**body, "top_k": 10**30}, served).top_k == 0  # ≥ vocabulary: off


def test_defaults_and_chat_template(served, tiny_target):
    p = parse_request("chat", {"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, served)
    expected = tiny_target.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert p.prompt_ids == list(expected)
    assert p.max_tokens == 64 - len(p.prompt_ids)  # the rest of the context, as vLLM
    assert p.temperature == 1.0 and not p.stream and 0 <= p.seed  # a random seed when none is given
    q = parse_request("completion", {"prompt": ["one prompt"], "max_tokens": 3}, served)
    assert q.prompt_ids == tiny_target.tokenizer.encode("one prompt")

