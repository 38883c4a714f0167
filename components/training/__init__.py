"""Drafter training: records → batches, one optimizer step, checkpoints, the Ray Train loop.

- ``batches``: data-stage records → padded :class:`DraftBatch` tensors; the held-out split.
- ``objectives``: registered objectives (offline, Draft-OPD, ...) and how a config chains them.
- ``rounds``: exact offline simulation of greedy draft–verify rounds over recorded rollouts.
- ``step``: optimizer/schedule and ``train_step`` over an objective module.
- ``checkpoints``: trainer checkpoints (drafter dir + optimizer/RNG safetensors + JSON), no pickle.
- ``evaluate``: α by position and τ of a drafter on held-out records.
- ``loop``: the per-worker function a Ray ``TorchTrainer`` runs (imports Ray lazily).

Nothing here branches on a drafter's or a loss's name.
"""

from components.training.batches import collate, heldout_ids, numpy_batch_to_draft
from components.training.checkpoints import load_checkpoint, save_checkpoint
from components.training.evaluate import evaluate_records
from components.training.step import (
    NonFiniteLossError,
    TrainState,
    build_train_loss,
    new_train_state,
    train_step,
)

__all__ = [
    "NonFiniteLossError",
    "TrainState",
    "build_train_loss",
    "collate",
    "evaluate_records",
    "heldout_ids",
    "load_checkpoint",
    "new_train_state",
    "numpy_batch_to_draft",
    "save_checkpoint",
    "train_step",
]
