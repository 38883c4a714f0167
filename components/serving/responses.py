"""OpenAI response bodies and SSE chunks for completions and chat, plus specline's per-request
speculative statistics.

The statistics go under the namespaced key ``"specline"`` of a response (and of the last
streamed chunk), named as vLLM's per-request spec-decode metrics::

    "specline": {"spec_decode": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                 "mean_acceptance_length", "draft_acceptance_rate", "rounds",
                                 "num_accepted_tokens_per_pos"},
                 "drafter": <served drafter id or null>, "speculate": bool}

``mean_acceptance_length`` = 1 + accepted / drafts (vLLM's definition: tokens per drafting
round). With ``stream_options.continuous_usage_stats`` (vLLM's) every chunk carries the usage
so far. Knows the OpenAI response schema; nothing about the engine's internals, HTTP or Ray.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from components.serving.protocol import GenerateParams


@dataclass
class SpecStats:
    """One request's drafting, as the engine reported it."""

    rounds: int = 0  # target verification passes after the prefill
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens, per round
    drafted: list[int] | None = field(default_factory=list)  # draft tokens per drafting round; None:
    # unknown (a stop string ended the request before the engine reported; accepted is then per round)

    def to_dict(self) -> dict[str, Any]:
        hits = sum(self.accepted)
        known = self.drafted is not None
        drafts = len(self.drafted) if known else self.rounds
        tokens = sum(self.drafted) if known else None
        per_pos = [0] * max(self.drafted or self.accepted or [0])
        for a in self.accepted:
            for k in range(a):
                per_pos[k] += 1
        return {"num_drafts": drafts if known else None, "num_draft_tokens": tokens, "num_accepted_tokens": hits,
                "mean_acceptance_length": 1 + hits / drafts if drafts else 1.0,
                "draft_acceptance_rate": hits / tokens if tokens else None, "rounds": self.rounds,
                "num_accepted_tokens_per_pos": per_pos}


@dataclass
class Outcome:
    """How one generation ended."""

    text: str  # the whole text (non-streaming) or the last delta (streaming)
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    spec: SpecStats
    drafter: str | None
    speculate: bool

    def specline(self) -> dict[str, Any]:
        return {"spec_decode": self.spec.to_dict(), "drafter": self.drafter, "speculate": self.speculate}

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, len(self.token_ids))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(request_id: str, model: str, kind: str, chunk: bool) -> dict[str, Any]:
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}[kind]
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model}


def full_response(request_id: str, model: str, params: GenerateParams, out: Outcome) -> dict[str, Any]:
    """The non-streaming body."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
    if params.kind == "chat":
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    if params.return_token_ids:
        choice["token_ids"] = out.token_ids
    body = _head(request_id, model, params.kind, chunk=False) | {"choices": [choice], "usage": out.usage(),
                                                                 "specline": out.specline()}
    if params.return_token_ids:
        body["prompt_token_ids"] = params.prompt_ids
    return body


def chunk(request_id: str, model: str, params: GenerateParams, text: str, token_ids: list[int] | None = None,
          first: bool = False, out: Outcome | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed chunk: a delta, or (``out`` given) the last one with its finish reason;
    ``usage`` (so far) goes in with ``continuous_usage_stats``, else null under ``include_usage``."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason if out else None}
    if params.kind == "chat":
        choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    else:
        choice["text"] = text
    if params.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    body = _head(request_id, model, params.kind, chunk=True) | {"choices": [choice]}
    if params.include_usage:
        body["usage"] = usage if params.continuous_usage else None
    if out is not None:
        body["specline"] = out.specline()
    return body


def usage_chunk(request_id: str, model: str, params: GenerateParams, out: Outcome) -> dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
    return _head(request_id, model, params.kind, chunk=True) | {"choices": [], "usage": out.usage(),
                                                                "specline": out.specline()}


def model_card(model: str, max_model_len: int, drafter: dict[str, Any] | None,
               engine: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/models`` body: the served model, its drafter and the engine's settings."""
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": int(time.time()), "owned_by": "specline",
        "max_model_len": max_model_len, "specline": {"drafter": drafter, "engine": engine}}]}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event (``data: ...``, blank line)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = sse("[DONE]")
