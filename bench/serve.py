"""Load generator for the serve stage, in the shape of ``vllm bench serve``: closed-loop
concurrency levels over HTTP on loopback, speculation on and off in one run.

    python bench/serve.py --drafter DIR [--method auto|suffix|hybrid] [--target embedded|DIR] [--concurrency 1,8,32]
                          [--requests N] [--new-tokens 64] [--threads 1] [--prefill-threads 0] [--no-adaptive]
                          [--loop-stages S] [--rollouts DATA_DIR]
                          [--target-step auto|fast|hf] [--step-precision float32|bfloat16|int8|int16] [--stream-interval-ms MS]
                          [--prefix-cache-tokens N]
    python bench/serve.py --url http://127.0.0.1:8000 --model NAME [--tokenizer DIR]   # any OpenAI server

Without ``--url`` it starts Ray and the specline app (``pipelines.serve.start_app``) with the
drafter, ``max_ongoing_requests`` = the highest concurrency, and at each level runs the same
held-out prompts (the embedded target's held-out split) twice, interleaved: ``spec off`` (every
request sends ``"speculate": false``: plain decoding in the same replica) and ``spec on``. With
``--url`` it drives a server that is already up (e.g. vLLM's ``api_server`` on the same target)
with the same client and prompts, one mode ("as served").

Every request: ``/v1/completions`` with the prompt as token ids, greedy, ``ignore_eos``,
``max_tokens = --new-tokens``, streamed with ``include_usage``. Reported per level and mode:
completed/failed, duration, request throughput, output tokens/s, TTFT / TPOT ((e2e − TTFT) /
(tokens − 1)) / ITL (every gap between chunks) / E2EL (mean, median, p99 in ms), the
acceptance length from the ``/metrics`` diff (1 + accepted / drafts, vLLM's counter names),
and output tokens/s relative to ``spec off`` at the same level; for a specline server, where the
engine's time went (busy share of the wall time; prefill, target passes, drafting, the rest of
its rounds), and where this machine's CPU went over the level (the replica, Ray Serve's HTTP proxy
and controller, the rest of Ray, this client, every other process; from the processes' own CPU
times, so a server on another machine shows as nothing). Nothing is asserted about time.

``--method suffix`` (no ``--drafter``) or ``hybrid`` serves suffix decoding, whose global tree
learns every response the server finishes: then each level runs prompts of its own, ``spec on``
before ``spec off``, so that no timed request is drafted from its own earlier answer (the warm-up
requests use a prompt of their own). ``--rollouts`` starts that global tree with a data
directory's responses (``serve.suffix_rollouts``; default: empty).

Both modes send the same prompts, so the server starts with ``serve.prefix_cache_tokens`` 0 (no
prompt prefixes kept across requests): the second mode would otherwise copy what the first left
of each prompt. ``--prefix-cache-tokens N`` serves with N (the serve stage's default is 4,096): for
a comparison with another server ("as served", ``--url``) or one mode alone.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


POLL_WAIT_S = 1.0


@dataclass
class Run:
    """One request as the client saw it."""

    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between chunks after the first


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="", help="drafter checkpoint directory (specline app)")
    ap.add_argument("--method", default="auto", choices=["auto", "suffix", "hybrid"],
                    help="serve.drafter: the checkpoint (auto), suffix decoding, or the hybrid of both")
    ap.add_argument("--target", default="embedded", help="embedded or an HF model directory")
    ap.add_argument("--url", default="", help="drive this running OpenAI server instead of starting one")
    ap.add_argument("--model", default="bench", help="model id to send (the served name)")
    ap.add_argument("--tokenizer", default="", help="with --url: tokenizer directory for the prompts")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(16, 2 x level))")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the replica")
    ap.add_argument("--prefix-cache-tokens", type=int, default=0,
                    help="serve.prefix_cache_tokens (default 0: off, since both modes send the same prompts)")
    ap.add_argument("--prefill-threads", type=int, default=0,
                    help="serve.prefill_threads: the fast step's threads in prompt passes (0: --threads)")
    ap.add_argument("--target-step", default="auto", choices=["auto", "fast", "hf"],
                    help="target.step of the replica (auto/fast: its linears through the kernel)")
    ap.add_argument("--step-precision", default="float32", choices=["float32", "bfloat16", "int8", "int16"],
                    help="target.step_precision of the replica (the fast step's block products on bfloat16 or integer inputs)")
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="serve.stream_interval_ms: at most one chunk per interval per stream (0: every round; "
                         "default: the config's)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--no-adaptive", action="store_true", help="fixed draft length instead of the adaptive cap")
    ap.add_argument("--loop-stages", type=int, default=None,
                    help="DLoop stages per round (default: serve's, 3 for block drafters; 1 = DLoop off)")
    ap.add_argument("--rollouts", default="none",
                    help="suffix/hybrid: a data stage's output directory whose responses start the global tree")
    return ap.parse_args()


# ----------------------------------------------------------------------------- the client
def one_request(url: str, body: dict[str, Any]) -> Run:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return Run(False)
        return _read_stream(resp, t0)
    except (OSError, http.client.HTTPException, ValueError):
        return Run(False)
    finally:
        conn.close()


def _read_stream(resp: Any, t0: float) -> Run:
    run, last = Run(True), None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        if event.get("usage"):
            run.tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices", [])):
            if last is None:
                run.ttft = now - t0
            else:
                run.gaps.append(now - last)
            last = now
    run.e2e = time.perf_counter() - t0
    return run


def closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[Run], float]:
    """``concurrency`` workers take the next request as each finishes; (runs, seconds)."""
    runs: list[Run] = []
    lock, it = threading.Lock(), iter(bodies)

    def worker() -> None:
        while True:
            with lock:
                body = next(it, None)
            if body is None:
                return
            run = one_request(url, body)
            with lock:
                runs.append(run)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs, time.perf_counter() - t0


COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
            "specline:spec_decode_draft_cap_sum", "specline:spec_decode_draft_cap_count",
            "specline:engine_rounds_total", "specline:engine_busy_seconds_total",
            "specline:engine_prefill_seconds_total", "specline:engine_forward_seconds_total",
            "specline:engine_draft_seconds_total")


def spec_counters(url: str) -> dict[str, float]:
    """Drafts, accepted tokens, the draft-cap histogram's sum and count and the engine's time
    counters from the server's /metrics (vLLM's names and specline's; 0 when absent)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return dict.fromkeys(COUNTERS, 0.0)
    finally:
        conn.close()
    total = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
    return total


# ----------------------------------------------------------------------------- report
def _ms(values: list[float]) -> str:
    if not values:
        return f"{'-':>7}{'-':>7}{'-':>7}"
    v = sorted(values)
    p99 = v[min(len(v) - 1, round(0.99 * (len(v) - 1)))]
    return f"{1000 * statistics.mean(v):7.1f}{1000 * statistics.median(v):7.1f}{1000 * p99:7.1f}"


HEADER = (f"{'conc':>4} {'mode':<10}{'ok':>4}{'fail':>5}{'secs':>7}{'req/s':>7}{'tok/s':>8}{'vs off':>7}{'tau':>6}"
          f"   {'TTFT mean/med/p99':>21}   {'TPOT':>21}   {'ITL':>21}   {'E2EL (ms)':>21}")


def report(conc: int, mode: str, runs: list[Run], secs: float, tau: float | None, base: float | None) -> float:
    good = [r for r in runs if r.ok]
    tokens = sum(r.tokens for r in good)
    tps = tokens / secs if secs else 0.0
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in good if r.tokens > 1]
    ratio = f"{tps / base:6.2f}x" if base else f"{'-':>7}"
    print(f"{conc:>4} {mode:<10}{len(good):>4}{len(runs) - len(good):>5}{secs:7.1f}{len(good) / secs:7.2f}"
          f"{tps:8.1f}{ratio}{(f'{tau:6.2f}' if tau else f'{chr(45):>6}')}   {_ms([r.ttft for r in good])}   "
          f"{_ms(tpot)}   {_ms([g for r in good for g in r.gaps])}   {_ms([r.e2e for r in good])}", flush=True)
    return tps


def engine_time(mode: str, secs: float, diff: dict[str, float]) -> None:
    """Where the replica's engine spent the level's wall time (a specline server's counters):
    busy in rounds, of it prefilling joining requests, the rounds' target passes and drafting;
    the rest of the wall time it waited for requests (client, HTTP, arrival gaps)."""
    rounds, busy = diff["specline:engine_rounds_total"], diff["specline:engine_busy_seconds_total"]
    if rounds <= 0 or secs <= 0:
        return
    part = {k: diff[f"specline:engine_{k}_seconds_total"] for k in ("prefill", "forward", "draft")}
    rest = busy - sum(part.values())
    print(f"{'':>4} {mode:<8} engine busy {busy:.1f} s ({busy / secs:.0%} of the wall time), {rounds:.0f} rounds "
          f"({1000 * (busy - part['prefill']) / rounds:.1f} ms a round past admission): prefill {part['prefill']:.1f} s, "
          f"target passes {part['forward']:.1f} s, drafting {part['draft']:.2f} s, the rest {rest:.1f} s")


# the processes whose CPU time the report splits out, by the title Ray gives them (else "other")
CPU_PARTS = (("ray::ServeReplica", "replica"), ("ray::ProxyActor", "HTTP proxy"),
             ("ray::ServeController", "Serve controller"))


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) every process on this machine has used so far, by part."""
    import os

    import psutil

    total: dict[str, float] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        cmd, times = " ".join(proc.info["cmdline"] or []), proc.info["cpu_times"]
        if times is None:
            continue
        part = next((name for prefix, name in CPU_PARTS if cmd.startswith(prefix)), None)
        if part is None:
            ray = cmd.startswith("ray::") or "/ray/" in cmd or "ray-dashboard" in cmd
            part = "this client" if proc.info["pid"] == os.getpid() else "the rest of Ray" if ray else "other"
        total[part] = total.get(part, 0.0) + times.user + times.system
    return total


def cpu_time(mode: str, secs: float, before: dict[str, float], after: dict[str, float]) -> None:
    """The level's CPU seconds by part (processes that ended meanwhile are not counted)."""
    parts = ["replica", "HTTP proxy", "Serve controller", "the rest of Ray", "this client", "other"]
    used = {p: max(0.0, after.get(p, 0.0) - before.get(p, 0.0)) for p in parts}
    print(f"{'':>4} {mode:<8} CPU over {secs:.1f} s: " + ", ".join(f"{p} {used[p]:.1f} s" for p in parts
                                                                   if p in after or p in before))


# ----------------------------------------------------------------------------- setup
def prompts_for(args: argparse.Namespace, count: int) -> tuple[list[list[int]], Any]:
    from components.config import EvalConfig, TargetConfig
    from components.evaluation.prompts import eval_prompts
    from components.target.hf import resolve_target_path

    if args.url and args.tokenizer:
        from transformers import AutoTokenizer

        tok, corpus = AutoTokenizer.from_pretrained(args.tokenizer), Path(args.tokenizer)
    else:
        path = resolve_target_path(TargetConfig(name_or_path=args.target))
        from transformers import AutoTokenizer

        tok, corpus = AutoTokenizer.from_pretrained(path), Path(path)
    got = eval_prompts(EvalConfig(num_prompts=count), tok, corpus if corpus.is_dir() else None)
    return [list(p.input_ids) for p in got], tok


def start_server(args: argparse.Namespace, top: int) -> str:
    from components.cluster import init_ray
    from components.config import RayConfig, ServeConfig, SpeclineConfig, TargetConfig
    from components.serving.provenance import DrafterSource
    from components.target.hf import resolve_target_path
    from pipelines.serve import start_app

    target = TargetConfig(name_or_path=args.target, step=args.target_step, step_precision=args.step_precision)
    path = resolve_target_path(target)
    sc = ServeConfig(port=args.port, model_name=args.model, max_ongoing_requests=top, max_queued_requests=2 * top,
                     adaptive=not args.no_adaptive, torch_threads=args.threads, cpus_per_replica=1.0,
                     prefill_threads=args.prefill_threads, prefix_cache_tokens=args.prefix_cache_tokens,
                     loop_stages=args.loop_stages, drafter=args.method,
                     suffix_rollouts=args.rollouts,  # a path field: made absolute by the config
                     **({} if args.stream_interval_ms is None else {"stream_interval_ms": args.stream_interval_ms}))
    init_ray(RayConfig())
    source = DrafterSource(str(Path(args.drafter).resolve()) if args.drafter else None, "bench",
                           method="model" if args.method == "auto" else args.method)
    start_app(SpeclineConfig(run_dir="runs", target=target, serve=sc), path, source, None)
    return f"http://127.0.0.1:{args.port}"


def main() -> None:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = {c: args.requests or max(16, 2 * c) for c in levels}
    # suffix decoding learns every response the server finishes: each level gets prompts of its
    # own, spec on runs before spec off, and the warm-up request's prompt is none of them
    learns = args.method != "auto" and not args.url
    need = (sum(counts.values()) if learns else max(counts.values())) + 1
    prompts, _ = prompts_for(args, need)
    warm, prompts = prompts[-1], prompts[:-1]
    if learns and len(prompts) < sum(counts.values()):
        print(f"note: {len(prompts)} held-out prompts for {sum(counts.values())} requests: later levels repeat "
              "prompts the server has learnt", file=sys.stderr)
    url = args.url or start_server(args, max(levels))
    modes = [("as served", None)] if args.url else [("spec off", False), ("spec on", True)]
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} tokens, greedy, ignore_eos, {url}"
          + (f", drafter {args.method}" if args.method != "auto" else ""))
    print(HEADER)
    start = 0
    for conc in levels:
        mine = [prompts[(start + i) % len(prompts)] for i in range(counts[conc])]
        start += counts[conc] if learns else 0
        done = {}
        for mode, speculate in (modes[::-1] if learns else modes):
            extra = {} if speculate is None else {"speculate": speculate}
            body = {"model": args.model, "max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, **extra}
            one_request(url, {**body, "prompt": warm})  # warm-up, not timed
            before, cpu = spec_counters(url), cpu_seconds()
            runs, secs = closed_loop(url, [{**body, "prompt": p} for p in mine], conc)
            cpu = cpu, cpu_seconds()
            time.sleep(POLL_WAIT_S)  # the replica copies engine counters into its metrics every 0.5 s
            done[mode] = runs, secs, {k: v - before[k] for k, v in spec_counters(url).items()}, cpu
        base = None
        for mode, _ in modes:
            runs, secs, diff, cpu = done[mode]
            drafts, capped = diff[COUNTERS[0]], diff[COUNTERS[3]]
            tau = 1 + diff[COUNTERS[1]] / drafts if drafts > 0 else None
            tps = report(conc, mode, runs, secs, tau, base)
            if capped > 0:
                print(f"{'':>4} {mode:<8} mean draft cap {diff[COUNTERS[2]] / capped:.2f} over {capped:.0f} rounds "
                      f"({drafts:.0f} drafting rounds)")
            engine_time(mode, secs, diff)
            cpu_time(mode, secs, *cpu)
            base = base or tps


if __name__ == "__main__":
    main()
