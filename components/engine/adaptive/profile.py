"""Profiled round times of the batch engine: the seconds of one whole round, drafting, the
verify pass, acceptance and cache bookkeeping included, per batch size B and draft cap G.

The adaptive draft-length policy (``policy.AdaptiveDraftLength``) needs the price of
every (B, G) it may pick before it has played it. A curve of the target's forward time alone,
``T(B·(G+1))``, misses what grows with G besides the forward: the drafter's own pass, the
per-row verification, the drafter consuming the verified states, the holes and compactions of
the ragged cache. On a compute-bound host (a CPU, a small model) these decide whether a cap
pays at all; a policy that must learn them online spends its first rounds of every batch size
drafting at a loss. So, as an inference server profiles its model before it takes traffic,
``profile_round_times`` runs the engine as configured on synthetic requests (random tokens, a
``context``-token prompt, greedy) and times ``rounds`` rounds per (B, G) after one warm-up,
the caps interleaved, keeping the median, made non-increasing towards smaller caps. Each pass
over the caps starts B fresh rows, so the rows' context stays near a served prompt's: a round
reads every row's cache, and in a batch that reading grows with the context as the weights'
does not.

With DLoop stages the caps run to γ·stages; every cap of the first stage is timed, and past it
only the ends of each stage (its first cap, which adds a drafting stage, and its last), the caps
between them linear in G (one more stage's drafting, a verify pass a token wider per cap):
three stages of γ = 7 time 12 caps instead of 22 (``profiled_caps``).

Acceptance does not enter the table (the policy gets it from confidences and what it sees),
but the rounds' holes and compactions depend on it, and a drafter that previews its match
(suffix decoding) drafts only where it has one: so a prompt repeats a random phrase, which a
target goes on repeating and drafters follow, and a cap is priced at the width (drafts per row)
its rounds really verified, read between the widths measured (``_by_width``); for a target
that does not repeat, the rounds are priced as rounds that draft in vain. The key holds the
timing method (``PROFILE_METHOD``), so a change to it measures every stored profile again.
``stored_round_times`` keeps a profile in
a JSON file and reuses it for the same target, drafter, engine settings, processor and threads.
``profile_forward_time`` is the cheaper table the policy falls back on: the target's forward
alone, T(n).

Runs models: the batch engine through its public API (``BatchEngine``, ``Request``) over an
``EngineSettings``, the target's ``forward``; nothing about rules, drafter families or HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from components.engine.adaptive.times import RoundTimes
from components.engine.batch.continuous import BatchEngine
from components.engine.batch.state import Request
from components.engine.core import sync_device
from components.engine.settings import EngineSettings, resolve_settings
from components.io import write_text
from components.spec.cost import ProfileTable
from components.target.kernels import cpuinfo

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILE_CONTEXT = 128  # prompt tokens of a profiled row: a short chat or code prompt
PROMPT_PERIOD = 16  # tokens of the phrase a profiled prompt repeats
# how rounds are timed, in the stored key: a change re-measures every stored profile (2: fresh
# rows for each pass over the caps; the engine's own thread holds the only OpenMP team)
PROFILE_METHOD = 2


@torch.no_grad()
def profile_forward_time(target: Any, sizes: tuple[int, ...] = DEFAULT_PROFILE_SIZES, context: int = 64,
                         reps: int = 5) -> ProfileTable:
    """T(n): median seconds of one target forward over n new tokens (as ``n/16`` rows of up to
    16 tokens) on top of a ``context``-token cache per row, made non-decreasing in n (a wider
    pass never costs less; timing noise on a busy host would otherwise invert neighbours) by
    taking the smallest time measured at n or above.
    Measured on ``target`` as it is."""
    dev, times = target.device, []
    for n in sizes:
        rows = max(1, n // 16) if n >= 16 else 1
        width = -(-n // rows)
        prefix = torch.randint(0, target.vocab_size, (rows, context), device=dev)
        new = torch.randint(0, target.vocab_size, (rows, width), device=dev)
        samples = []
        for _ in range(reps + 1):
            cache = target.forward(prefix, use_cache=True).cache
            sync_device(dev)
            t0 = time.perf_counter()
            target.forward(new, cache=cache, use_cache=True)
            sync_device(dev)
            samples.append(time.perf_counter() - t0)
        times.append(sorted(samples[1:])[reps // 2])
    # T(n) = min over m ≥ n of the measured T(m): robust to a slow early (cold) measurement
    monotone = torch.tensor(times, dtype=torch.float64).flip(0).cummin(dim=0).values.flip(0)
    return ProfileTable(list(sizes), monotone)


class _PinnedCap:
    """A draft-length policy whose cap the profiler sets between rounds."""

    adapts = True  # asked every round, as an adaptive policy is (the rounds timed are those it plays)
    calibrate = False
    row_lengths = None  # every row drafts the cap

    def __init__(self) -> None:
        self.value = 0
        self.drafted = 0

    def empirical_survival(self, max_cap: int) -> Tensor:
        return torch.ones(max_cap, dtype=torch.float64)

    def cap(self, survival: Tensor, max_cap: int, remaining: list[int] | None = None) -> int:
        return min(self.value, max_cap)

    def observe(self, accepted: list[int], drafted: list[int], *args: Any, **kwargs: Any) -> None:
        self.drafted = sum(drafted)  # the round's drafts, over every row


def profiled_caps(max_cap: int, gamma: int) -> list[int]:
    """The caps ``profile_round_times`` times: 0..γ, then each later stage's first and last cap."""
    gamma = max(1, min(int(gamma), int(max_cap)))
    later = {c for start in range(gamma + 1, max_cap + 1, gamma) for c in (start, min(start + gamma - 1, max_cap))}
    return sorted(set(range(gamma + 1)) | later)


def _by_width(caps: list[int], samples: list[list[float]], widths: list[list[float]], max_cap: int) -> list[float]:
    """Seconds for every cap 0..max_cap, priced as the policy reads them: cap G as a round whose
    rows draft G each. Cap 0 is its median round; a drafting cap is placed at the width (drafts
    per row) its rounds really verified (the median of each), since a drafter may draft less
    than the cap (a suffix match shorter than it, a row it stopped following) and a row near its
    end is cut; seconds are then read at every whole width, linear between the widths measured
    and past the widest along the slope of them all. Without a drafting round (nothing drafted),
    the caps' own medians (``_fill_caps``)."""
    medians = {cap: statistics.median(x) for cap, x in zip(caps, samples)}
    points: dict[float, list[float]] = {}
    for cap, x, w in zip(caps, samples, widths):
        width = statistics.median(w) if w else 0.0
        if cap and width > 0:
            points.setdefault(round(width, 3), []).append(statistics.median(x))
    if 0 not in medians or not points:
        return _fill_caps(medians, max_cap)
    xs = [0.0, *sorted(points)]
    ys = [medians[0], *(statistics.mean(points[w]) for w in xs[1:])]
    slope = (ys[-1] - ys[1]) / (xs[-1] - xs[1]) if len(xs) > 2 else 0.0
    return [medians[0]] + [float(np.interp(g, xs, ys)) if g <= xs[-1] else ys[-1] + slope * (g - xs[-1])
                           for g in range(1, max_cap + 1)]


def _fill_caps(measured: dict[int, float], max_cap: int) -> list[float]:
    """Seconds for every cap 0..max_cap, linear between the measured ones (``profiled_caps``)."""
    known = sorted(measured)
    out = []
    for cap in range(max_cap + 1):
        if cap in measured:
            out.append(measured[cap])
            continue
        lo = max(c for c in known if c < cap)
        hi = min(c for c in known if c > cap)
        out.append(measured[lo] + (cap - lo) / (hi - lo) * (measured[hi] - measured[lo]))
    return out


@torch.no_grad()
def profile_round_times(target: Any, drafter: Any, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                        settings: EngineSettings | None = None, context: int = PROFILE_CONTEXT, rounds: int = 4,
                        seed: int = 0) -> RoundTimes:
    """Median seconds of ``rounds`` engine rounds (after one warm-up) for every batch size in
    ``batch_sizes`` and every cap 0..γ·stages of ``drafter`` (past γ: ``profiled_caps``, the rest
    interpolated), the ``BatchEngine`` drafting by ``settings`` as it will serve (DLoop stages,
    carryover, ...; default: ``resolve_settings(drafter)``)."""
    if drafter is None:
        raise ValueError("profile_round_times needs a drafter: without one every round is plain")
    settings = settings or resolve_settings(drafter)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for bsz in sorted({int(b) for b in batch_sizes}):
        pinned = _PinnedCap()
        engine = BatchEngine(target, drafter, max_batch_size=bsz, draft_length=pinned, settings=settings)
        caps = profiled_caps(settings.max_cap, settings.num_speculative_tokens)
        budget = len(caps) * (settings.max_cap + 1) + 2  # no request ends early
        samples: list[list[float]] = [[] for _ in caps]
        widths: list[list[float]] = [[] for _ in caps]  # drafts per row each timed round verified
        for rep in range(rounds + 1):  # caps interleaved: a slow spell of the host hits them all
            # fresh rows each pass over the caps: the context stays near ``context`` tokens (a
            # looping target's rows would otherwise grow by the cap every round, and a round's
            # reading of the cache with them)
            pinned.value = 0
            for _ in range(bsz):
                engine.add(Request(_looping_prompt(target.vocab_size, context, gen), budget))
            engine.step()  # admission (prefills) and a first round: not timed
            order = list(enumerate(caps))  # up, then down: no cap always meets the shortest context
            for i, cap in order if rep % 2 else order[::-1]:
                pinned.value, pinned.drafted = cap, 0
                t0 = time.perf_counter()
                engine.step()
                if rep:  # the first pass warms every width up
                    samples[i].append(time.perf_counter() - t0)
                    widths[i].append(pinned.drafted / bsz)
            for request_id in engine.running:
                engine.cancel(request_id)
            engine.step()
        rows.append(_by_width(caps, samples, widths, settings.max_cap))
    # seconds(B, G) = min over G' ≥ G of the measured: a narrower cap never costs more than a
    # wider one, and a slow (cold, interrupted) measurement is not believed
    seconds = torch.tensor(rows, dtype=torch.float64).flip(1).cummin(dim=1).values.flip(1)
    return RoundTimes(sorted({int(b) for b in batch_sizes}), seconds)


def _looping_prompt(vocab_size: int, context: int, gen: torch.Generator, period: int = PROMPT_PERIOD) -> list[int]:
    """``context`` tokens: a random phrase of ``period`` tokens, repeated. A target continues a
    repetition from its first token on, so drafters find and follow it at once, as they do the
    repetitive parts of real traffic (code, quoted text), and the rounds timed verify drafts
    that are accepted (holes, compactions and the drafter's consuming as in real rounds)."""
    phrase = torch.randint(0, vocab_size, (period,), generator=gen)
    return phrase.repeat(-(-context // period))[:context].tolist()


def profile_key(target: Any, drafter: Any, batch_sizes: Sequence[int], settings: EngineSettings,
                context: int = PROFILE_CONTEXT, rounds: int = 4, seed: int = 0) -> dict[str, Any]:
    """What a stored profile was measured for: target and what runs its passes, drafter (its declared ``identity()`` and
    the largest cap), batch sizes, engine settings, how it was timed, device, dtype and threads.
    A profile is only reused for an equal key."""
    return {"target": str(getattr(target, "name_or_path", type(target).__name__)),
            "forward": str(getattr(target, "forward_kind", type(target).__name__)),
            "drafter": f"{drafter.identity()}:{settings.max_cap}",
            "batch_sizes": sorted({int(b) for b in batch_sizes}),
            "engine": settings.describe(),
            "timing": {"context": context, "rounds": rounds, "seed": seed, "method": PROFILE_METHOD},
            "device": str(target.device), "host": host_processor(target.device), "dtype": str(target.dtype),
            "threads": torch.get_num_threads()}


def host_processor(device: Any) -> str:
    """The processor a timing ran on, as the system names it: the GPU's name on CUDA, else the
    CPU's model name (Linux's ``/proc/cpuinfo``; the platform's word elsewhere) and how many
    logical CPUs there are. A profile directory shared between machines (a home directory, a
    VM moved to other hardware) must not hand one machine's times to another."""
    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    name = cpuinfo("model name") or platform.processor() or platform.machine()
    return f"{name} x {os.cpu_count()}"


@dataclass
class StoredProfile:
    """A round profile as ``stored_round_times`` found or measured it."""

    times: RoundTimes
    path: Path  # the file it is kept in
    reused: bool  # True: read from ``path``; False: measured now and written there

    def describe(self) -> str:
        return f"{'stored' if self.reused else 'measured'}: {self.path.name}"


def stored_round_times(profile_dir: str | Path, target: Any, drafter: Any,
                       batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                       notice: Callable[[Path], None] | None = None, settings: EngineSettings | None = None,
                       context: int = PROFILE_CONTEXT, rounds: int = 4, seed: int = 0) -> StoredProfile:
    """The profile of this setting kept under ``profile_dir``, one file per ``profile_key`` (a
    serving replica, the eval stage and the benches share them): read when its key matches,
    else measured by ``profile_round_times`` (``notice(path)`` called first: it takes a while)
    and written there (to a temporary file, then renamed), so it is measured once per machine
    and setting."""
    settings = settings or resolve_settings(drafter)
    key = profile_key(target, drafter, batch_sizes, settings, context, rounds, seed)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(profile_dir) / f"round-profile-{digest}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            stored = RoundTimes.from_dict(data) if data.get("key") == key else None
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"round profile {path}: unreadable ({err}); delete it to profile again") from None
        if stored is not None:
            return StoredProfile(stored, path, True)
    if notice is not None:
        notice(path)
    times = profile_round_times(target, drafter, batch_sizes, settings, context, rounds, seed)
    write_text(path, json.dumps({"key": key, **times.to_dict()}, indent=1))
    return StoredProfile(times, path, False)
