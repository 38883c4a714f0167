"""A drafter that cannot take the engine down: a failure inside the drafter turns the affected
requests into plain decoding, losslessly, and is logged and counted.

``GuardedDrafter(drafter)`` has the drafter's engine protocol (its capabilities, taps and γ are
the wrapped drafter's) and wraps each request's drafter state in a ``Slot``. Every call the
engine can make is guarded: the core interface (``init_state``, ``consume``, ``propose``,
``rollback``) and every method a capability names (``Capability.methods``), the set read off
those declarations, so a new capability's methods are guarded without an edit here. What a
failed call answers is chosen by the result its signature declares (``declared_signature``):

* a drafter state (one, or one per row): a failed ``Slot``; calls on a failed slot then answer
  the same without calling the drafter;
* a proposal (one, or one per row): a *null proposal*: the last token repeated, with the one-hot
  q it was "sampled" from and confidence 0. Every rule stays lossless with it (greedy matches
  tokens; speculative/block sampling gets the true q of its drafts; Gumbel reads the target's
  noise), so the request's output is what it would have been; the zero confidence makes the
  adaptive draft cap choose plain rounds for such rows (with a fixed cap they verify the null
  drafts, which costs a little width and accepts what the target itself would emit);
* a causal tree head: flat scores (a failure inside the returned head is caught the same way):
  the tree is still verified exactly, it only accepts less;
* a tensor or None (``preview``): None, "not known" (the engine keeps its own estimate).

``observe`` (``LEARNS_RESPONSES``) answers nothing: a failed one only loses that response.
A batched call (a list of slots) runs on the rows still live; a failure marks all of them. A
method whose declared result is none of these (a training internal: block states, train
readouts) is no engine call and is passed through. Requests admitted later get fresh states
and the real drafter again. Knows the drafter interface and its capability declarations;
nothing about requests, HTTP or Ray.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import Drafter, Proposal
from components.drafters.capabilities import Capability, declared_signature

log = logging.getLogger(__name__)
NULL_LOGIT = -1e9  # every token but the null draft's: exp() is exactly 0 in float32


@dataclass
class Slot:
    """One request's drafter state, and whether the drafter failed on it (a failed ``propose``
    marks the slot in place: the engine keeps the slot it proposed from until it consumes)."""

    inner: Any  # the wrapped drafter's state (None once failed)
    failed: bool = False


FAILED = Slot(None, True)
STATE, STATES, PROPOSAL, PROPOSALS, HEAD = "DraftState", "list[DraftState]", "Proposal", "list[Proposal]", "CausalHead"
MAYBE = "Tensor | None"  # e.g. a preview: None is always an answer (not known)
STAND_IN_FOR = (STATE, STATES, PROPOSAL, PROPOSALS, HEAD, MAYBE)  # declared results a failed call can answer


@functools.cache
def _declared(method: str) -> inspect.Signature | None:
    """``method``'s declared signature (without ``self``): a capability's Protocol, else ``Drafter``."""
    sig = declared_signature(method)
    core = getattr(Drafter, method, None)
    if sig is None and inspect.isfunction(core):
        full = inspect.signature(core)
        sig = full.replace(parameters=list(full.parameters.values())[1:])
    return sig


@dataclass(frozen=True)
class _Bound:
    """A call's arguments bound by the declared names (what ``inspect.BoundArguments`` gives:
    ``args``, ``kwargs``, ``arguments``), laid out as ``_layout`` worked out once per way of
    calling: ``Signature.bind`` on every guarded call cost about 20 us, several times a round."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    names: tuple[str, ...]  # the declared name of each of ``args``

    @property
    def arguments(self) -> dict[str, Any]:
        return {**dict(zip(self.names, self.args)), **self.kwargs}


@functools.cache
def _layout(method: str, positional: int, keywords: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """How ``method``'s declared signature binds a call of ``positional`` arguments and these
    ``keywords``: the names of the bound positional arguments, in order, and the keywords that
    stay keywords. A call that does not fit it raises TypeError, as ``Signature.bind`` does."""
    sig = _declared(method)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"{method}: a declared signature with *args or **kwargs is not laid out once")  # none is
    bound = sig.bind(*range(positional), **{k: None for k in keywords})
    return tuple(p.name for p in params[:len(bound.args)]), tuple(bound.kwargs)


def _bind(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Bound:
    """``args``/``kwargs`` of a call of ``method`` bound by its declared names."""
    names, keywords = _layout(method, len(args), tuple(kwargs))
    return _Bound(args + tuple(kwargs[n] for n in names[len(args):]), {k: kwargs[k] for k in keywords}, names)


def _returns(method: str) -> str:
    sig = _declared(method)
    return "" if sig is None else str(sig.return_annotation)


GUARDED = frozenset(m for c in Capability for m in c.methods if _returns(m) in STAND_IN_FOR)


class GuardedDrafter:
    """The wrapped drafter, with failures confined to the requests they hit (module docstring)."""

    def __init__(self, drafter: Any, vocab_size: int):
        self.drafter, self.vocab_size = drafter, int(vocab_size)
        self.failures = 0  # calls that raised (each turns one or more requests plain)
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # taps, γ, capabilities, parameters, ... of the drafter
        if name == "drafter":
            raise AttributeError(name)  # not set yet (unpickling): never recurse
        value = getattr(self.drafter, name)  # AttributeError when the drafter has no such member
        return functools.partial(self._call, name) if name in GUARDED else value

    # ------------------------------------------------------------------ the core interface
    def init_state(self, batch_size: int) -> Slot:
        return self._call("init_state", batch_size)

    def consume(self, state: Slot, tokens: Tensor, hidden: Tensor | None) -> Slot:
        return self._call("consume", state, tokens, hidden)

    def propose(self, state: Slot, last_token: Tensor, *args: Any, **kwargs: Any) -> Proposal:
        return self._call("propose", state, last_token, *args, **kwargs)

    def rollback(self, state: Slot, length: int) -> Slot:
        return self._call("rollback", state, length)

    def observe(self, response: Sequence[int], key: Hashable | None = None) -> None:
        """``LEARNS_RESPONSES``: a failure only loses this response (logged and counted)."""
        try:
            self.drafter.observe(response, key)
        except Exception as err:  # noqa: BLE001
            self._failed("observe", err, 0)

    # ------------------------------------------------------------------ one guarded call
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.drafter, name)
        bound = _bind(name, args, kwargs)  # by the declared names (a wrapped method has its own)
        first = args[0] if args else None
        if isinstance(first, Slot):
            return self._one(name, method, first, bound)
        if isinstance(first, list) and first and all(isinstance(s, Slot) for s in first):
            return self._many(name, method, first, bound)
        return self._stateless(name, method, bound)

    def _one(self, name: str, method: Callable[..., Any], slot: Slot, bound: _Bound) -> Any:
        if not slot.failed:
            try:
                result = method(slot.inner, *bound.args[1:], **bound.kwargs)
                return Slot(result) if _returns(name) == STATE else result
            except Exception as err:  # noqa: BLE001  (any drafter failure falls back)
                self._failed(name, err, 1)
                slot.failed = True  # a proposal's slot is kept by the engine: consume() now leaves it failed
        return self._stand_in(name, bound, None)

    def _many(self, name: str, method: Callable[..., Any], slots: list[Slot], bound: _Bound) -> list:
        live = [i for i, s in enumerate(slots) if not s.failed]
        got = dict(zip(live, self._live_rows(name, method, slots, live, bound))) if live else {}
        return [got[i] if i in got else self._stand_in(name, bound, i) for i in range(len(slots))]

    def _live_rows(self, name: str, method: Callable[..., Any], slots: list[Slot], live: list[int],
                   bound: _Bound) -> list[Any]:
        """The batched call on the ``live`` rows (their states and per-row arguments); [] once it failed."""
        n = len(slots)
        try:
            got = method([slots[i].inner for i in live], *(_rows(a, live, n) for a in bound.args[1:]),
                         **{k: _rows(v, live, n) for k, v in bound.kwargs.items()})
        except Exception as err:  # noqa: BLE001
            self._failed(name, err, len(live))
            for i in live:
                slots[i].failed = True
            return []
        return [Slot(r) for r in got] if _returns(name) == STATES else list(got)

    def _stateless(self, name: str, method: Callable[..., Any], bound: _Bound) -> Any:
        try:
            result = method(*bound.args, **bound.kwargs)
        except Exception as err:  # noqa: BLE001
            self._failed(name, err, 1)
            return self._stand_in(name, bound, None)
        kind = _returns(name)
        return Slot(result) if kind == STATE else self._guarded_head(name, result) if kind == HEAD else result

    def _failed(self, call: str, err: BaseException, rows: int) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = f"{call}: {type(err).__name__}: {err}"
        log.warning("drafter failed in %s (%s rows fall back to plain decoding): %s", call, rows, self.last_error)

    # ------------------------------------------------------------------ stand-ins
    def _stand_in(self, name: str, bound: _Bound, row: int | None) -> Any:
        """What a failed call of ``name`` answers for one row (``row`` of a batched call)."""
        kind = _returns(name)
        if kind in (STATE, STATES):
            return FAILED
        if kind == MAYBE:
            return None
        if kind == HEAD:
            return flat_head
        args = bound.arguments
        last = args.get("last_tokens", args.get("last_token"))
        gamma = args.get("num_speculative_tokens")
        gamma = gamma[row] if isinstance(gamma, list) and row is not None else gamma
        last = last if row is None else last[row:row + 1]
        return self.null_proposal(last, int(gamma or self.drafter.num_speculative_tokens))

    def _guarded_head(self, name: str, head: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """The causal head, with a failure inside it answered by ``flat_head``."""
        def guarded(*args: Any) -> Tensor:
            try:
                return head(*args)
            except Exception as err:  # noqa: BLE001
                self._failed(name, err, 1)
                return flat_head(*args)
        return guarded

    def null_proposal(self, last_token: Tensor, gamma: int) -> Proposal:
        """``gamma`` copies of the last token [B], one-hot q, confidence 0 (module docstring)."""
        rows = last_token.reshape(-1).shape[0]
        tokens = last_token.reshape(rows, 1).expand(rows, gamma).clone()  # [B, γ]
        probs = torch.zeros(rows, gamma, self.vocab_size, device=last_token.device)  # [B, γ, V]
        probs.scatter_(2, tokens[..., None], 1.0)
        logits = torch.full_like(probs, NULL_LOGIT).masked_fill(probs > 0, 0.0)
        return Proposal(tokens, logits, probs, torch.zeros(rows, gamma, device=last_token.device))


def flat_head(paths: Tensor, depth: Tensor, candidates: Tensor) -> Tensor:  # [n, γ+1], [n], [n, M] -> [n, M]
    """A causal tree head that scores every candidate alike (the backbone's order decides)."""
    return torch.zeros(candidates.shape, dtype=torch.float32, device=candidates.device)


def _rows(value: Any, live: list[int], n: int) -> Any:
    """The live rows of a per-row argument of a batched call (a list or tensor of ``n`` rows)."""
    if isinstance(value, list) and len(value) == n:
        return [value[i] for i in live]
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
        return value[torch.tensor(live, device=value.device)]
    return value
