"""Drafter training: inputs, records → batches, one optimizer step, checkpoints, the Ray Train
fit, the held-out report.

- ``inputs``: the data stage's shards or rollout stream → one :class:`TrainInputs` (train split
  as a Ray Dataset, held-out records in memory).
- ``padding``: data-stage records → right-padded :class:`DraftBatch` tensors.
- ``objectives``: registered objectives (offline, Draft-OPD, ...) and ``chain``: how a config chains them.
- ``rounds``: exact offline simulation of greedy draft–verify rounds over recorded rollouts.
- ``step``: optimizer/schedule and ``train_step`` over an objective module.
- ``resume``: trainer checkpoints (drafter dir + optimizer/RNG safetensors + JSON), no pickle.
- ``sharding``: DDP / FSDP of the workers.
- ``loop``: the per-worker function a Ray ``TorchTrainer`` runs; ``fit``: launching it per objective.
- ``heldout``: the held-out split, α by position and τ of a drafter on it.
- ``report``: held-out metrics, the α plot and the registered model version of a stage.

Nothing here branches on a drafter's or a loss's name. Modules that need Ray, MLflow or
matplotlib (``inputs``, ``loop``, ``fit``, ``report``) import them lazily and are not imported here.
"""

from components.training.heldout import evaluate_records, heldout_ids
from components.training.padding import collate, numpy_batch_to_draft
from components.training.resume import load_checkpoint, save_checkpoint
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
