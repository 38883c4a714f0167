"""The replica without HTTP or Ray: greedy output equals the target's own; a drafter failure
falls back to plain decoding with the same output and is counted; an engine failure makes the
replica unhealthy; it refuses requests (503 warming_up) until its warm-up is done and is dead
after a failed warm-up; admission refuses past capacity at once; a drafter for another target is
refused naming the mismatch; the adaptive cap's round profile is measured once and reused."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from components.config import ConfigError, ServeConfig
from components.engine.adaptive.profile import profile_key
from components.serving.app import on_a_thread_of_its_own, served_for, warm_up_steps
from components.serving.assemble import build_parts
from components.serving.protocol import APIError, parse_request
from components.serving.provenance import DrafterSource
from components.serving.replica import Replica
from components.serving.responses import Outcome
from tests.components.data.test_data_records import rollout_dir
from tests.components.serving.conftest import greedy_reference, make_parts, prompt_ids

NEW = 12


async def _run(replica: Replica, body: dict) -> Outcome:
    params = parse_request("completion", body, replica.served)
    replica.admit()
    out = None
    async for item in replica.generate(params):
        out = item
    assert isinstance(out, Outcome)
    return out


def _greedy(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}


async def _many(replica: Replica, bodies: list[dict]) -> list[Outcome]:
    return await asyncio.gather(*(_run(replica, b) for b in bodies))


@pytest.fixture
def replica(tiny_target_cfg, tiny_target_build, serving_drafter):
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter)
    rep = Replica(parts, served, sc.max_queued_requests, drafter_label="test")
    assert rep.warm_up()
    yield rep
    rep.shutdown()


def test_greedy_is_the_targets_own_and_counted(replica, tiny_target):
    prompts = prompt_ids(tiny_target, 6)
    outs = asyncio.run(_many(replica, [_greedy(p) for p in prompts]))
    assert [o.token_ids for o in outs] == [greedy_reference(tiny_target, p, NEW) for p in prompts]
    assert all(o.spec.drafted for o in outs) and replica.admitted == 0
    replica.counters.export()
    text = replica.metrics.render()
    assert replica.metrics.value("vllm:spec_decode_num_drafts") > 0
    assert 'vllm:request_success_total{model_name="tiny",finished_reason="length"} 6' in text
    # where the engine's time went: its rounds' target passes, admission (prefill) and drafting are parts of it
    busy, parts = replica.metrics.value("specline:engine_busy_seconds"), [replica.metrics.value(
        f"specline:engine_{k}_seconds") for k in ("forward", "prefill", "draft")]
    assert replica.metrics.value("specline:engine_rounds") >= NEW and all(0 < t for t in parts) and sum(parts) <= busy


class Flaky:
    """Raises in every batched or single propose after ``ok`` calls (a drafter fault mid-round)."""

    def __init__(self, inner, ok: int):
        self.inner, self.ok = inner, ok

    def __call__(self, *args, **kwargs):
        self.ok -= 1
        if self.ok < 0:
            raise RuntimeError("drafter kernel fault")
        return self.inner(*args, **kwargs)


def test_drafter_failure_falls_back_losslessly(replica, tiny_target):
    drafter = replica.parts.drafter.drafter
    method = "propose_many" if hasattr(drafter, "propose_many") else "propose"
    setattr(drafter, method, Flaky(getattr(drafter, method), ok=2))
    prompts = prompt_ids(tiny_target, 4)
    bodies = [_greedy(p) for p in prompts] + [{**_greedy(prompts[0]), "temperature": 0.8, "seed": 5}]
    outs = asyncio.run(_many(replica, bodies))
    assert [o.token_ids for o in outs[:4]] == [greedy_reference(tiny_target, p, NEW) for p in prompts]
    assert replica.parts.drafter.failures >= 1 and replica.healthy
    replica.counters.export()
    assert replica.metrics.value("specline:spec_decode_fallbacks") >= 1
    # the same sampled request without speculation: the Gumbel rule makes it the same output
    plain = asyncio.run(_run(replica, {**bodies[-1], "speculate": False}))
    assert plain.token_ids == outs[-1].token_ids


def test_engine_failure_makes_the_replica_unhealthy(replica, tiny_target):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    replica.parts.engine.target = type("Broken", (), {"forward": staticmethod(broken),
                                                       "device": tiny_target.device})()
    with pytest.raises(APIError) as info:
        asyncio.run(_run(replica, _greedy(prompt_ids(tiny_target, 1)[0])))
    assert info.value.status == 503 and "device lost" in info.value.message
    with pytest.raises(RuntimeError, match="engine is dead"):
        replica.life.check_health()
    assert replica.status()["status"] == "dead"
    with pytest.raises(APIError) as info:
        replica.admit()
    assert info.value.status == 503 and info.value.headers["Retry-After"]


def test_requests_are_refused_until_the_warm_up_is_done(tiny_target_cfg, tiny_target_build, serving_drafter,
                                                        tiny_target):
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter)
    rep = Replica(parts, served, sc.max_queued_requests, retry_after_s=2)
    try:
        with pytest.raises(APIError) as info:
            rep.admit()
        err = info.value
        assert (err.status, err.code, err.headers) == (503, "warming_up", {"Retry-After": "2"})
        assert rep.status()["status"] == "warming_up" and not rep.healthy and rep.admitted == 0
        rep.life.check_health()  # passes while warming up: Ray Serve would count a failure as a failed start
        assert warm_up_steps(rep, sc) == []  # fixed γ: nothing but the warm-up generation
        assert rep.warm_up() and rep.healthy and rep.status()["status"] == "ok"
        assert parts.engine.stats.drafting_rounds > 0  # the warm-up generation ran, speculatively
        rep.counters.export()
        assert rep.metrics.value("vllm:spec_decode_num_drafts") == 0  # ... and is not exported as traffic
        prompt = prompt_ids(tiny_target, 1)[0]
        assert asyncio.run(_run(rep, _greedy(prompt))).token_ids == greedy_reference(tiny_target, prompt, NEW)
    finally:
        rep.shutdown()


def test_warm_up_measures_the_adaptive_cap_or_fails_the_replica(tiny_target_cfg, tiny_target_build,
                                                                serving_drafter, tmp_path):
    sc = ServeConfig(adaptive=True, profile_dir=str(tmp_path), max_ongoing_requests=2, num_speculative_tokens=2)
    parts = build_parts(tiny_target_cfg, sc, str(tiny_target_build[0]), DrafterSource(str(serving_drafter), "test"),
                        adapt_now=False)
    assert not parts.settings["adaptive"] and not list(tmp_path.glob("*.json"))  # left for the warm-up
    rep = Replica(parts, served_for(parts.target, sc, "tiny"), 2)
    try:
        assert [phase for phase, _ in warm_up_steps(rep, sc)] == ["round profile"]
        assert rep.warm_up(warm_up_steps(rep, sc)) and rep.healthy
        assert parts.settings["adaptive"] and parts.settings["round_profile"].startswith("measured")
        assert rep.engine.engine is parts.engine  # the engine thread drives the rebuilt engine
    finally:
        rep.shutdown()

    def broken() -> None:
        raise OSError("profile_dir is read-only")

    failed = Replica(parts, served_for(parts.target, sc, "tiny"), 2)
    assert not failed.warm_up([("round profile", broken)])
    error = failed.life.error
    assert failed.status()["status"] == "dead" and "round profile" in error and "read-only" in error
    with pytest.raises(RuntimeError, match="read-only"):
        failed.life.check_health()
    with pytest.raises(APIError) as info:
        failed.admit()
    assert info.value.status == 503 and info.value.code == "engine_dead"
    failed.shutdown()


def test_admission_refuses_past_capacity_at_once(tiny_target_cfg, tiny_target_build):
    parts, served, _ = make_parts(tiny_target_cfg, tiny_target_build, None, max_ongoing_requests=1)
    rep = Replica(parts, served, max_queued=1, overload_status=429, retry_after_s=1)
    try:
        assert rep.warm_up()
        rep.admit()
        rep.admit()
        with pytest.raises(APIError) as info:
            rep.admit()
        err = info.value
        assert err.status == 429 and err.headers == {"Retry-After": "1"} and err.body()["error"]["code"]
        assert rep.metrics.value("specline:requests_rejected", reason="overload") == 1
    finally:
        rep.shutdown()


def test_drafter_for_another_target_is_refused(tiny_target_cfg, tiny_target_build, serving_drafter, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(serving_drafter, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["target_tokenizer_hash"], cfg["target_vocab_size"] = "0" * 16, cfg["target_vocab_size"] + 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="tokenizer hash.*vocabulary size|vocabulary size.*tokenizer hash"):
        make_parts(tiny_target_cfg, tiny_target_build, other)


def test_round_profile_is_measured_once_and_reused(tiny_target_cfg, tiny_target_build, serving_drafter, tmp_path):
    kwargs = {"adaptive": True, "profile_dir": str(tmp_path), "max_ongoing_requests": 2, "num_speculative_tokens": 2}
    first, _, _ = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter, **kwargs)
    again, _, _ = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter, **kwargs)
    assert first.settings["round_profile"].startswith("measured")
    assert again.settings["round_profile"].startswith("stored") and len(list(tmp_path.glob("*.json"))) == 1
    assert first.settings["adaptive"] and first.settings["num_speculative_tokens"] == 2
    # the guard forwards the drafter's identity: the file is the one the eval stage's
    # drafter_adaptive reads for the same drafter and settings
    key = profile_key(first.target, first.drafter, [1, 2], first.engine_settings)
    assert key == profile_key(first.target, first.drafter.drafter, [1, 2], first.engine_settings)


def test_dloop_is_on_by_default_and_the_adaptive_cap_decides_its_stages(tiny_target_cfg, tiny_target_build,
                                                                        serving_drafter, tiny_target, tmp_path):
    """serve.loop_stages unset: 3 stages for a block drafter, the gate left open for the adaptive
    cap (its cap over γ·3 decides how many a round drafts); greedy output stays the target's."""
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter, adaptive=True,
                                   profile_dir=str(tmp_path), max_ongoing_requests=2, num_speculative_tokens=2)
    assert parts.settings["loop_stages"] == 3 and parts.settings["loop_gate"] == "adaptive cap"
    assert parts.engine.max_cap == 6
    rep = Replica(parts, served, sc.max_queued_requests)
    try:
        assert rep.warm_up()
        prompts = prompt_ids(tiny_target, 3)
        outs = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))
        assert [o.token_ids for o in outs] == [greedy_reference(tiny_target, p, NEW) for p in prompts]
    finally:
        rep.shutdown()
    fixed, _, _ = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter, num_speculative_tokens=2)
    assert fixed.settings["loop_stages"] == 3 and fixed.settings["loop_gate"] == -0.5  # no cap to decide
    off, _, _ = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter, loop_stages=1)
    assert off.settings["loop_stages"] == 1 and off.engine.max_cap == off.engine.num_speculative_tokens
    with pytest.raises(ConfigError, match="loop_stages must be at least 1"):
        ServeConfig(loop_stages=0)


def test_min_tokens_lets_early_stop_ids_pass_and_stays_lossless(replica, tiny_target):
    """vLLM's min_tokens: a stop id ends the output only past min_tokens; the tokens are the
    target's own greedy ones throughout (an early stop id is generated, it just does not end it)."""
    prompt, n = prompt_ids(tiny_target, 2)[1], 24
    ref = greedy_reference(tiny_target, prompt, n)
    stop = max(set(ref), key=lambda t: (ref.count(t), -ref.index(t)))  # a token the output repeats
    first = ref.index(stop)

    def expected(min_tokens: int) -> tuple[list[int], str]:
        ends = [i for i, t in enumerate(ref) if t == stop and i + 1 > min_tokens]
        return (ref[:ends[0] + 1], "stop") if ends else (ref, "length")

    for min_tokens in (0, first + 1, n):
        body = {**_greedy(prompt), "max_tokens": n, "stop_token_ids": [stop], "min_tokens": min_tokens}
        out = asyncio.run(_run(replica, body))
        assert (out.token_ids, out.finish_reason) == expected(min_tokens), min_tokens
    assert replica.admitted == 0


def test_on_the_fast_step_the_replica_batches_in_slab_rows_losslessly(tiny_target_cfg, tiny_target_build,
                                                                    serving_drafter, tiny_target):
    """``target.step: fast``: the replica's target is the static-slab step and its batch engine
    keeps requests in slab rows; greedy output is still the target's own."""
    import dataclasses

    from components.target.fast import StepTarget
    from components.target.kernels import why_unavailable
    from tests.components.target.test_step import _same_or_near_tie

    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=256)
    parts, served, sc = make_parts(cfg, tiny_target_build, serving_drafter)
    assert isinstance(parts.target, StepTarget) and parts.engine.pool is not None
    assert parts.settings["target_step"].startswith("target step: fast")
    rep = Replica(parts, served, sc.max_queued_requests, drafter_label="test")
    assert rep.warm_up()
    try:
        prompts = prompt_ids(tiny_target, 6)
        outs = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))
        for p, o in zip(prompts, outs):
            _same_or_near_tie(tiny_target, p, o.token_ids, greedy_reference(tiny_target, p, NEW))
        assert sorted(parts.engine.pool.free) == list(range(parts.engine.pool.rows))
    finally:
        rep.shutdown()


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_suffix_and_hybrid_serve_the_targets_own_and_learn_each_finished_response(
        tiny_target_cfg, tiny_target_build, serving_drafter, tiny_target, method, tmp_path):
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter if method == "hybrid" else None,
                                   method=method, adaptive=True, profile_dir=str(tmp_path))
    assert parts.family == ("suffix" if method == "suffix" else "hybrid+dspark")
    assert parts.adapts and parts.settings["adaptive"]  # the adaptive cap, measured at build (adapt_now)
    rep = Replica(parts, served, sc.max_queued_requests, drafter_label=method)
    try:
        assert rep.warm_up()
        prompts = prompt_ids(tiny_target, 5)
        outs = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))
        assert [o.token_ids for o in outs] == [greedy_reference(tiny_target, p, NEW) for p in prompts]
        suffix = parts.drafter.drafter if method == "suffix" else parts.drafter.drafter.suffix
        kept = sorted(tuple(suffix.responses.tree.seqs[i]) for i in suffix.responses.kept.values())
        warm = 1  # the warm-up generation's response is learnt too
        assert len(kept) == len(prompts) + warm
        assert all(tuple(o.token_ids) in kept for o in outs)
        again = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))  # drafted from what it learnt: same output
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    finally:
        rep.shutdown()


def test_suffix_decoding_starts_from_the_rollouts_and_stays_lossless(tiny_target_cfg, tiny_target_build,
                                                                    tiny_target, tmp_path):
    """``serve.suffix_rollouts``: the replica's global tree starts with a data directory's
    responses (here the target's own continuations of the very prompts, so rounds draft from
    them), output is still the target's own; a directory that is not a data stage's is refused."""
    prompts = prompt_ids(tiny_target, 3)
    refs = [greedy_reference(tiny_target, p, NEW) for p in prompts]
    data = rollout_dir(tmp_path / "data", tiny_target.tokenizer_hash, refs)
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, None, method="suffix", suffix_rollouts=str(data))
    suffix = parts.drafter.drafter
    assert suffix.responses.tokens == sum(map(len, refs)) and parts.settings["suffix_rollouts"] == str(data)
    rep = Replica(parts, served, sc.max_queued_requests, drafter_label="suffix")
    try:
        assert rep.warm_up()
        outs = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))
        assert [o.token_ids for o in outs] == refs
        assert parts.engine.stats.accepted > 0  # drafted from the rollouts
    finally:
        rep.shutdown()
    with pytest.raises(ConfigError, match="serve.suffix_rollouts: .*no manifest"):
        make_parts(tiny_target_cfg, tiny_target_build, None, method="suffix", suffix_rollouts=str(tmp_path))


def test_models_reports_the_prefill_threads_the_target_uses(tiny_target_cfg, tiny_target_build):
    """serve.prefill_threads is the fast step's; transformers' forward prefills on torch_threads."""
    parts, _, sc = make_parts(tiny_target_cfg, tiny_target_build, None, method="none", prefill_threads=2)
    assert parts.target.batch_cache != "slots" and parts.settings["prefill_threads"] == sc.torch_threads


def test_suffix_with_carryover_is_a_config_error(tiny_target_cfg, tiny_target_build):
    with pytest.raises(ConfigError, match="serve.carryover: suffix decoding"):
        make_parts(tiny_target_cfg, tiny_target_build, None, method="suffix", carryover=True)


def test_the_replica_is_built_on_a_thread_that_ends():
    """The constructor's build runs on a thread of its own (its OpenMP team dies with it): the
    value comes back, an exception is raised on the caller's thread, and the thread is gone."""
    import threading

    seen: list[threading.Thread] = []

    def build(x: int) -> int:
        seen.append(threading.current_thread())
        return x + 1

    assert on_a_thread_of_its_own(build, 41) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ConfigError, match="bad field"):
        on_a_thread_of_its_own(lambda: (_ for _ in ()).throw(ConfigError("bad field")))


def test_a_stream_interval_serves_the_same_tokens_and_counts_every_round(tiny_target_cfg, tiny_target_build,
                                                                         serving_drafter, tiny_target):
    """Chunks merged by ``serve.stream_interval_ms`` (here longer than any request): the target's
    own greedy tokens, a stop string still ends the text where it starts, and the statistics of
    a request cut by it still list each round (not one merged chunk as one round)."""
    parts, served, sc = make_parts(tiny_target_cfg, tiny_target_build, serving_drafter)
    rep = Replica(parts, served, sc.max_queued_requests, drafter_label="test", stream_interval_s=3600.0)
    assert rep.warm_up()
    try:
        prompts = prompt_ids(tiny_target, 4)
        outs = asyncio.run(_many(rep, [_greedy(p) for p in prompts]))
        assert [o.token_ids for o in outs] == [greedy_reference(tiny_target, p, NEW) for p in prompts]
        n = 24
        full = asyncio.run(_run(rep, {**_greedy(prompts[2]), "max_tokens": n}))
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        cut = asyncio.run(_run(rep, {**_greedy(prompts[2]), "max_tokens": n, "stop": [stop]}))
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
        cap = parts.engine.max_cap
        assert cut.spec.rounds == len(cut.spec.accepted) >= (len(cut.token_ids) - 1) // (cap + 1)
        assert all(0 <= a <= cap for a in cut.spec.accepted)
    finally:
        rep.shutdown()
