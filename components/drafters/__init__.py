"""Drafters: one module per family behind one interface (base.py), registered by name.

The trainer and the engine use only :class:`Drafter` methods and :func:`build_drafter` /
:func:`load_drafter` (a reduced draft vocabulary: ``vocab.py``, chosen by :func:`with_draft_vocab`);
they never branch on a drafter's name. Importing this package registers
the built-in families (dspark, dflash, dflash2, domino, d_loop, dedit, hspec, eagle3, peagle, medusa, mtp).
"""

from components.drafters import (  # noqa: F401  (registration)
    dflash,
    dflash2,
    domino,
    dspark,
    eagle3,
    hspec,
    medusa,
    mtp,
    multipass,
    peagle,
)
from components.drafters.base import (
    LAYER_ID_CONVENTION,
    DraftBatch,
    Drafter,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    SharedParts,
    TargetInfo,
    TargetKV,
    spread_layer_ids,
)
from components.drafters.checkpoint import load_drafter, save_drafter
from components.drafters.registry import (
    DRAFTERS,
    build_drafter,
    drafter_class,
    register_drafter,
    resolve_spec,
    with_draft_vocab,
)
from components.drafters.vocab import DraftVocab, select_draft_vocab

__all__ = [
    "DRAFTERS",
    "LAYER_ID_CONVENTION",
    "DraftBatch",
    "DraftState",
    "DraftTrainOutput",
    "DraftVocab",
    "Drafter",
    "DrafterError",
    "DrafterSpec",
    "Proposal",
    "SharedParts",
    "TargetInfo",
    "TargetKV",
    "build_drafter",
    "drafter_class",
    "load_drafter",
    "register_drafter",
    "resolve_spec",
    "save_drafter",
    "select_draft_vocab",
    "spread_layer_ids",
    "with_draft_vocab",
]
