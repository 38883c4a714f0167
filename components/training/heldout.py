"""The held-out split, and α by draft position and the τ estimates of a drafter on it (no gradients).

The split (:func:`heldout_ids`) is a seeded hash of the sample ids, so the driver, every worker
and every rerun agree on it whatever the shard order. Two estimates, side by side:

* from distributions: α_k = 1 − TV(p_k, q_k) averaged over every valid draft position k of
  every block (random anchors), weighted by how many blocks reach k; τ = 1 + Σ_k Π_{i≤k} α_i
  as the loss reports it — the expected acceptance of speculative *sampling* at temperature 1;
* from simulated greedy rounds (components/training/rounds.py): rounds anchored where they
  really start, greedy drafts checked against the recorded tokens; ``sim_tau`` is mean tokens
  per round and ``sim_alpha`` the acceptance rate of draft k among rounds reaching it.

Anchors are drawn from a generator seeded by ``seed``, so two drafters are compared on the
same blocks. Knows the drafter interface and the loss output; nothing about Ray or files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from components.config import TrainConfig
from components.data.records import Record
from components.drafters.base import Drafter
from components.losses import DrafterLoss
from components.training.padding import chunks, collate
from components.training.rounds import Rounds, simulate_rounds
from components.training.step import build_train_loss


def heldout_ids(sample_ids: Sequence[str], fraction: float, seed: int) -> set[str]:
    """A deterministic held-out subset: the ``fraction`` (≥ 1 record, < all) with the smallest
    seeded hash. Independent of shard order, so the driver and every worker agree."""
    ids = sorted(set(sample_ids))
    if len(ids) < 2 or fraction <= 0:
        return set()
    k = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    key = lambda s: hashlib.sha256(f"{seed}:{s}".encode()).hexdigest()
    return set(sorted(ids, key=key)[:k])


def evaluate_heldout(tc: TrainConfig, drafter: Drafter, records: Sequence[Record]) -> dict[str, object]:
    """:func:`evaluate_records` with the stage's ``train.loss`` and eval batch size (the same for
    every objective of a chain, so their numbers compare)."""
    return evaluate_records(drafter, build_train_loss(tc), records, tc.eval_batch_size, tc.seed)


@torch.no_grad()
def evaluate_records(drafter: Drafter, loss: DrafterLoss, records: Iterable[Record], batch_size: int = 8,
                     seed: int = 0) -> dict[str, object]:
    """{"loss", "alpha" [γ], "tau", "blocks", "sim_tau", "sim_alpha" [γ], "rounds"} over
    ``records``; empty dict without data."""
    was_training = drafter.training
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    alpha_sum: torch.Tensor | None = None  # [γ] Σ α_k · (blocks reaching k)
    count: torch.Tensor | None = None  # [γ] blocks reaching k
    tau_sum = loss_sum = 0.0
    blocks = 0
    sim = Rounds([], [], [])
    for group in chunks(records, batch_size):
        batch = collate(group)
        sim.extend(simulate_rounds(drafter, batch))
        out = drafter.training_forward(batch, gen)
        lo = loss(out.loss_inputs())
        n_k = out.valid.sum(0).double()  # [γ]
        n = int(out.valid[:, 0].sum())
        if n == 0:
            continue
        a = torch.nan_to_num(lo.alpha.double()) * n_k
        alpha_sum = a if alpha_sum is None else alpha_sum + a
        count = n_k if count is None else count + n_k
        tau_sum += float(lo.tau) * n
        loss_sum += float(lo.loss) * n
        blocks += n
    drafter.train(was_training)
    if not blocks or alpha_sum is None or count is None:
        return {}
    alpha = (alpha_sum / count.clamp_min(1)).tolist()
    gamma = len(alpha)
    return {"loss": loss_sum / blocks, "alpha": alpha, "tau": tau_sum / blocks, "blocks": blocks,
            "sim_tau": sim.tau(), "sim_alpha": sim.position_acceptance(gamma),
            "rounds": sum(len(a) for a in sim.accepted)}
