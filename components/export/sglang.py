"""EAGLE-3 drafters in the layout SGLang loads (``--speculative-algorithm EAGLE3``).

``architectures: ["LlamaForCausalLMEagle3"]``, a Llama config with ``num_hidden_layers: 1`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (exactly 3). SGLang adds +1 internally (it
captures the input of layer i+1 = the output of layer i), so specline's ids are written
unchanged. Weights as vLLM's native EAGLE-3 layout (``midlayer.*``, ``fc``, ``norm``,
``lm_head``) plus ``d2t`` (int64 offsets, target = draft + d2t[draft]) / ``t2d`` (bool [V]): the
drafter's draft vocabulary, or the identity map (all 0 / all True) for the full one (SGLang turns
d2t into its hot-token map; vLLM 0.32 refuses a d2t for a full vocabulary, so the vLLM layouts
write both only for a draft vocabulary). Not run against SGLang here: its loader skips
unknown keys silently, so the tests check every name. Other drafters are refused with the list of what SGLang export supports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from components.drafters.base import Drafter
from components.export.vllm import ExportError, Tensors, eagle3_export, write_dir

SGLANG_EXPORTABLE = ("eagle3",)


def sglang_export(drafter: Drafter, target: Any) -> tuple[dict[str, Any], Tensors]:
    """(config.json dict, weights) of an EAGLE-3 drafter in SGLang's layout."""
    if drafter.registry_name not in SGLANG_EXPORTABLE:
        raise ExportError(f"no SGLang layout for drafter '{drafter.registry_name}' "
                          f"(exportable: {', '.join(SGLANG_EXPORTABLE)})")
    if len(drafter.layer_ids) != 3:
        raise ExportError(f"SGLang EAGLE-3 needs exactly 3 aux layers, drafter has {drafter.layer_ids}")
    config, tensors = eagle3_export(drafter, target, "native")
    vocab = drafter.spec.target.vocab_size
    if "d2t" not in tensors:  # the full vocabulary: the identity map
        tensors.update({"d2t": torch.zeros(vocab, dtype=torch.int64), "t2d": torch.ones(vocab, dtype=torch.bool)})
    del config["eagle_aux_hidden_state_layer_ids"]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
                              "use_aux_hidden_state": True}
    return config, tensors


def export_sglang(drafter: Drafter, target: Any, path: str | Path) -> Path:
    """Writes the drafter for ``--speculative-draft-model-path`` (algorithm EAGLE3)."""
    config, tensors = sglang_export(drafter, target)
    return write_dir(path, config, tensors)
