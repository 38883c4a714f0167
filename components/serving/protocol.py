"""The OpenAI-compatible request schema: a JSON body → checked ``GenerateParams``, or an
``APIError`` that names the field.

Every field of ``/v1/completions`` and ``/v1/chat/completions`` is either honoured
(``HONOURED``), accepted only at its neutral value (``NEUTRAL``: ``n=1``, ``logprobs=null``,
``presence_penalty=0``, ...), or refused: anything else — an unsupported feature at another
value, or a field no one defines — is a 400 naming it, never silently ignored. vLLM's own
extensions are read as its server defines them (``ignore_eos``, ``min_tokens``, ``top_k``,
``stream_options.continuous_usage_stats``, ...; load-testing tools send them), those of features
this server lacks (guided decoding, beam search, penalties) at their defaults only. Errors follow
vLLM's server: 400 with ``{"error": {"message", "type", "param", "code"}}`` and ``param`` the
field path (``messages[1].content``), 404 for an unknown model, not FastAPI's 422.

Prompts are tokenized here (a string, token ids, or messages through the target's chat
template) because their length decides errors: an empty prompt, a prompt past the context,
``max_tokens`` past what is left of it, token ids outside the vocabulary; so are the bodies of
vLLM's ``/tokenize`` and ``/detokenize``. The sampling fields become the engine's own
``SamplingParams`` here, so a new one is a field there and its check here. Knows the OpenAI
schema, a tokenizer, the context length and ``SamplingParams``; nothing about the engine, HTTP
or Ray.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from components.spec.sampling import SamplingParams

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
EXTENSIONS = {  # fields beyond OpenAI's, as vLLM's server names and defines them (speculate: specline's own)
    "top_k", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "return_token_ids", "speculate"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
          "user", "n"} | EXTENSIONS
HONOURED = {"completion": COMMON | {"prompt", "add_special_tokens"}, "chat": COMMON | {"messages", "max_completion_tokens"}}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # continuous: usage on every chunk (vLLM's)
NEUTRAL: dict[str, tuple[Any, ...]] = {  # unsupported features, accepted at these values only
    # OpenAI's
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}), "service_tier": (None, "auto", "default"),
    "store": (None, False), "metadata": (None, {}), "modalities": (None, ["text"]),
    # vLLM's extensions, at the defaults its server gives them
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "return_tokens_as_token_ids": (None, False), "priority": (None, 0),
    "logits_processors": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,), "request_id": (None,), "cache_salt": (None,), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "add_special_tokens": (None, False), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "documents": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None,),
}
ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An error the client gets as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or _KINDS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_KINDS = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


@dataclass
class Served:
    """What request checks need of the served model."""

    model: str  # the served model id
    tokenizer: Any
    vocab_size: int
    max_model_len: int  # prompt + new tokens
    eos_ids: tuple[int, ...]  # the target's eos ids (Target.eos_ids): end the generation unless ignore_eos


@dataclass
class GenerateParams:
    """One checked generation request (either endpoint)."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # temperature 0: greedy
    seed: int = 0  # drawn at random when the client gave none
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()  # eos ids included unless ignore_eos
    min_tokens: int = 0  # stop ids end the output only after this many tokens
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk too
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    speculate: bool = True
    user: str | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_request(kind: str, body: dict[str, Any], served: Served) -> GenerateParams:
    """``kind`` "completion" or "chat": a checked request, or an ``APIError`` naming the field."""
    _check_fields(kind, body)
    _check_model(body, served)
    prompt_ids = _completion_prompt(body, served) if kind == "completion" else _chat_prompt(body, served)
    stream = _typed(body, "stream", bool, False)
    max_tokens = _max_tokens(kind, body, len(prompt_ids), served)
    return GenerateParams(kind, prompt_ids, max_tokens, stream=stream, **_sampling(body, served.vocab_size),
                          **_stops(body, served, max_tokens), **_options(body, stream))


# ----------------------------------------------------------------------------- fields
def _check_fields(kind: str, body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in HONOURED[kind]:
            continue
        if key in NEUTRAL:
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in NEUTRAL[key]):
                raise APIError(400, f"'{key}' is not supported by this server (only {NEUTRAL[key][1:] or 'null'} "
                                    f"is accepted, got {value!r})", param=key, code="unsupported_field")
            continue
        raise APIError(400, f"unknown field '{key}' for {kind} requests", param=key, code="unknown_field")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise APIError(400, f"'n' must be 1 (one choice per request is supported), got {n!r}", param="n",
                       code="unsupported_field")


def _check_model(body: dict[str, Any], served: Served) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {type(model).__name__}", param="model")
    if model != served.model:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{served.model}')",
                       param="model", code="model_not_found")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """``body[key]`` (``default`` when absent or null) if it has type ``kind``, else a 400."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and _is_int(value):
        value, ok = float(value), True
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{key}' must be {names}, got {type(value).__name__} ({value!r})", param=key)
    return value


def _max_tokens(kind: str, body: dict[str, Any], prompt_len: int, served: Served) -> int:
    left = served.max_model_len - prompt_len
    key = "max_tokens"
    value = _typed(body, "max_tokens", int, None)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        other = _typed(body, "max_completion_tokens", int, None)
        if value is not None and value != other:
            raise APIError(400, f"'max_tokens' ({value}) and 'max_completion_tokens' ({other}) disagree",
                           param="max_completion_tokens")
        key, value = "max_completion_tokens", other
    if value is None:
        return left
    if value < 1:
        raise APIError(400, f"'{key}' must be at least 1, got {value}", param=key)
    if value > left:
        raise APIError(400, f"'{key}' is too large: {value} new tokens after a {prompt_len}-token prompt exceed "
                            f"the context of {served.max_model_len} tokens (at most {left})", param=key)
    return value


def _sampling(body: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    temperature = _typed(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _typed(body, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _typed(body, "top_k", int, 0)
    if top_k < -1:
        raise APIError(400, f"'top_k' must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    seed = _typed(body, "seed", int, None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise APIError(400, f"'seed' must be in [0, 2^63 - 1], got {seed}", param="seed")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k if 0 < top_k < vocab_size else 0)
    return {"sampling": sampling, "seed": secrets.randbelow(MAX_SEED) if seed is None else seed}


def _stops(body: dict[str, Any], served: Served, max_tokens: int) -> dict[str, Any]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    ids = _typed(body, "stop_token_ids", list, [])
    _check_ids(ids, served, "stop_token_ids")
    ignore_eos = _typed(body, "ignore_eos", bool, False)
    eos = () if ignore_eos else served.eos_ids
    min_tokens = _typed(body, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise APIError(400, f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}",
                       param="min_tokens")
    return {"stop": stop, "stop_token_ids": tuple(dict.fromkeys([*ids, *eos])), "min_tokens": min_tokens}


def _options(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    options = _typed(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with stream=true", param="stream_options")
    options = options or {}
    unknown = sorted(set(options) - set(STREAM_OPTIONS))
    if unknown:
        raise APIError(400, f"'stream_options' supports {list(STREAM_OPTIONS)} only (got {unknown})",
                       param=f"stream_options.{unknown[0]}", code="unknown_field")
    usage = {key: _typed(options, key, bool, False) for key in STREAM_OPTIONS}
    user = _typed(body, "user", str, None)
    return {"include_usage": usage["include_usage"],
            "continuous_usage": usage["include_usage"] and usage["continuous_usage_stats"],
            "include_stop_str_in_output": _typed(body, "include_stop_str_in_output", bool, False),
            "skip_special_tokens": _typed(body, "skip_special_tokens", bool, True),
            "return_token_ids": _typed(body, "return_token_ids", bool, False),
            "speculate": _typed(body, "speculate", bool, True), "user": user}


# ----------------------------------------------------------------------------- prompts
def _check_ids(ids: list[Any], served: Served, param: str) -> None:
    bad = [t for t in ids if not _is_int(t) or not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(400, f"'{param}' holds {len(bad)} value(s) that are not token ids of this model's "
                            f"vocabulary [0, {served.vocab_size}): {bad[:5]}", param=param)


def _check_prompt_len(ids: list[int], served: Served, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"'{param}' is empty: at least one prompt token is needed", param=param)
    if len(ids) >= served.max_model_len:
        raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context is {served.max_model_len} "
                            "tokens (prompt and at least one new token)", param=param, code="context_length_exceeded")
    return ids


def _completion_prompt(body: dict[str, Any], served: Served) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        ids = served.tokenizer.encode(prompt, add_special_tokens=_typed(body, "add_special_tokens", bool, True))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        _check_ids(prompt, served, "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"'prompt' holds {len(prompt)} prompts; one prompt per request is supported",
                       param="prompt", code="unsupported_field")
    else:
        raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    return _check_prompt_len(ids, served, "prompt")


def message_text(message: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", param=where)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise APIError(400, f"'{where}.role' must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role")
    extra = sorted(set(message) - {"role", "content", "name"})
    if extra:
        raise APIError(400, f"'{where}' has unsupported fields {extra}", param=f"{where}.{extra[0]}",
                       code="unsupported_field")
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if any(not isinstance(p, str) for p in parts):
            raise APIError(400, f"'{where}.content' parts must be text parts ({{'type': 'text', 'text': ...}}); "
                                "this model reads text only", param=f"{where}.content")
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, f"'{where}.content' must be a string or a list of text parts, got "
                            f"{type(content).__name__}", param=f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _chat_prompt(body: dict[str, Any], served: Served) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
    return _check_prompt_len(_templated(messages, served), served, "messages")


def _templated(messages: list[Any], served: Served) -> list[int]:
    """Checked messages through the target's chat template, with the assistant turn opened."""
    turns = [message_text(m, i) for i, m in enumerate(messages)]
    if getattr(served.tokenizer, "chat_template", None) is None:
        raise APIError(400, f"the model '{served.model}' has no chat template; use /v1/completions",
                       param="messages")
    ids = served.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return list(ids)


# ----------------------------------------------------------------------------- tokenizer routes
def tokenize_request(body: dict[str, Any], served: Served) -> dict[str, Any]:
    """``/tokenize`` as vLLM's: ``{"prompt"}`` or ``{"messages"}`` → ``{"count", "max_model_len", "tokens"}``."""
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages'", param="prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        tokens = list(served.tokenizer.encode(body["prompt"], add_special_tokens=special))
    else:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
        tokens = _templated(msgs, served)
    return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}


def detokenize_request(body: dict[str, Any], served: Served) -> dict[str, Any]:
    """``/detokenize`` as vLLM's: ``{"tokens"}`` → ``{"prompt"}``."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < served.vocab_size for t in tokens):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {served.vocab_size})", param="tokens")
    return {"prompt": served.tokenizer.decode(tokens)}
