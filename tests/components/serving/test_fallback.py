"""The drafter guard in the served engine: a failure injected into every method of the drafter's
interface and capabilities, on every round kind (chain, DLoop, carryover, token tree, causal
token tree), leaves greedy output equal to the target's own, is counted, and the replica stays
healthy; the guarded set is the capability declarations' own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from torch import nn

from components.config import DrafterConfig
from components.drafters.capabilities import Capability
from components.serving.fallback import (
    FAILED,
    GUARDED,
    STAND_IN_FOR,
    GuardedDrafter,
    _bind,
    _declared,
    _returns,
)
from components.serving.protocol import parse_request
from components.serving.replica import Replica
from components.serving.responses import Outcome
from tests.components.serving.conftest import greedy_reference, make_parts, prompt_ids

NEW = 10
CORE = ("init_state", "consume", "propose", "rollback")
ROUND_KINDS = {  # serve settings of each round kind; trees run for a lone request
    "chain": {"loop_stages": 1, "carryover": False},
    "dloop": {"loop_stages": 3, "carryover": False, "loop_gate": -1e9},  # every stage drafts
    "carryover": {"loop_stages": 1, "carryover": True},
    "tree": {"loop_stages": 1, "carryover": False, "tree_budget": 8, "tree_builder": "ddtree"},
    "causal tree": {"loop_stages": 1, "carryover": False, "tree_budget": 8, "tree_builder": "causal"},
}


@pytest.fixture(scope="module")
def able_drafter(tmp_path_factory, tiny_target) -> Path:
    """A drafter with every engine-facing capability (carryover embedding, Markov tree head)."""
    from components.drafters import build_drafter, save_drafter

    torch.manual_seed(0)
    cfg = DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8, carryover=True)
    return save_drafter(build_drafter(cfg, tiny_target), tmp_path_factory.mktemp("fallback") / "drafter")


class Fault:
    """Stands in for one drafter method (or a head module's forward) and raises on every call."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise RuntimeError(f"injected fault in {self.name}")


def inject(drafter: nn.Module, name: str) -> tuple[Fault, callable]:
    """A ``Fault`` in the drafter's member ``name`` and the call that removes it."""
    fault = Fault(name)
    member = getattr(drafter, name)
    if isinstance(member, nn.Module):
        member.forward = fault
        return fault, lambda: delattr(member, "forward")
    setattr(drafter, name, fault)  # an instance attribute shadows the method
    return fault, lambda: delattr(drafter, name)


def faultable(drafter: nn.Module) -> list[str]:
    """Every callable member the drafter's interface and its declared capabilities name."""
    names = [m for c in drafter.capabilities() for m in c.methods]
    return [*CORE, *(m for m in names if callable(getattr(drafter, m)))]


async def _generate(replica: Replica, prompt: list[int]) -> list[int]:
    params = parse_request("completion", {"prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                          "ignore_eos": True}, replica.served)
    replica.admit()
    out = [item async for item in replica.generate(params)][-1]
    assert isinstance(out, Outcome)
    return out.token_ids


def _serve(replica: Replica, prompts: list[list[int]], lone: bool) -> list[list[int]]:
    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(_generate(replica, p) for p in prompts)))

    return [asyncio.run(_generate(replica, p)) for p in prompts] if lone else asyncio.run(together())


def test_the_guarded_set_is_the_capability_declarations():
    declared = {m for c in Capability for m in c.methods}
    assert {"propose_many", "consume_many", "consume_own", "with_carry", "causal_tree_head"} <= GUARDED <= declared
    # what is left out declares a result no engine round uses (training internals, attributes)
    assert all(_returns(m) not in STAND_IN_FOR for m in declared - GUARDED)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ROUND_KINDS))
def test_a_failure_anywhere_in_the_drafter_is_lossless(kind, tiny_target_cfg, tiny_target_build, able_drafter,
                                                       tiny_target):
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, able_drafter, **ROUND_KINDS[kind])
    replica = Replica(parts, served, sc.max_queued_requests)
    lone = sc.tree_budget > 0
    prompts = prompt_ids(tiny_target, 1 if lone else 3)
    expected = [greedy_reference(tiny_target, p, NEW) for p in prompts]
    try:
        assert replica.warm_up()
        guard, reached = parts.drafter, []
        for name in faultable(guard.drafter):
            fault, remove = inject(guard.drafter, name)
            before = guard.failures
            try:
                assert _serve(replica, prompts, lone) == expected, name
            finally:
                remove()
            assert (guard.failures > before) == (fault.calls > 0), name  # each failure counted
            assert replica.healthy and replica.admitted == 0, name
            reached += [name] * (fault.calls > 0)
        assert _serve(replica, prompts, lone) == expected  # the real drafter again for new requests
        replica.counters.export()
        assert replica.metrics.value("specline:spec_decode_fallbacks") >= len(reached) > 0
        replica.life.check_health()
    finally:
        replica.shutdown()
    must = {"chain": {"propose_many", "consume_many"}, "dloop": {"consume_own"}, "carryover": {"with_carry"},
            "tree": {"propose"}, "causal tree": {"causal_tree_head", "propose"}}[kind]
    assert must <= set(reached), f"{kind} rounds never called {must - set(reached)}"


def test_a_failed_observe_loses_only_that_response(tiny_target):
    from components.engine import SuffixDrafter

    class Forgetful(SuffixDrafter):
        def observe(self, response, key=None):
            raise RuntimeError("tree full")

    guarded = GuardedDrafter(Forgetful(tiny_target.vocab_size, 4, max_depth=16), tiny_target.vocab_size)
    guarded.observe([1, 2, 3])  # logged and counted, never raised into the engine's round
    assert guarded.failures == 1 and "observe: RuntimeError: tree full" in guarded.last_error


def test_a_preview_reads_the_slots_state_and_a_failed_one_is_not_known(tiny_target):
    """``preview`` (draft-then-decide) is guarded: it reads the wrapped state, and a failure, or
    a failed slot, answers None (the engine keeps its own estimate), counted as a failure."""
    from components.engine import SuffixDrafter

    class Blind(SuffixDrafter):
        def preview(self, state, recent):
            raise RuntimeError("no lookup")

    guarded = GuardedDrafter(SuffixDrafter(tiny_target.vocab_size, 4, max_depth=16), tiny_target.vocab_size)
    slot = guarded.consume(guarded.init_state(1), torch.tensor([[1, 2, 3, 1]]), None)
    # "1 2" went on with 3, 1, each seen once: (1 + 1) / (1 + 2)
    assert torch.allclose(guarded.preview(slot, torch.tensor([[2]])), torch.full((1, 2), 2 / 3))
    assert guarded.preview(FAILED, torch.tensor([[2]])) is None and guarded.failures == 0
    blind = GuardedDrafter(Blind(tiny_target.vocab_size, 4, max_depth=16), tiny_target.vocab_size)
    assert blind.preview(blind.init_state(1), torch.tensor([[2]])) is None and blind.failures == 1


@pytest.mark.parametrize("args,kwargs", [
    (("s", "t"), {}),  # positional only
    (("s", "t", "greedy"), {"generator": "g"}),  # a keyword that binds in place
    (("s", "t"), {"num_speculative_tokens": 3}),  # one after a skipped default: stays a keyword
    (("s",), {"last_token": "t", "sampling": "greedy", "generator": "g", "num_speculative_tokens": 2}),
])
def test_a_calls_arguments_bind_as_the_declared_signature_binds_them(args, kwargs):
    """The guard binds each call by the declared names from a layout worked out once per way of
    calling; it gives what ``Signature.bind`` gives, and a call that does not fit is a TypeError."""
    want = _declared("propose").bind(*args, **kwargs)
    for _ in range(2):  # the layout worked out, then read back
        got = _bind("propose", args, kwargs)
        assert (got.args, got.kwargs, got.arguments) == (want.args, want.kwargs, dict(want.arguments))
    with pytest.raises(TypeError):
        _bind("propose", args, {**kwargs, "temperature": 0.5})
