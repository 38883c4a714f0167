"""Exporters: specline drafters as directories vLLM and SGLang load (safetensors + config.json).

Only this package knows engines' field names and layer-id conventions; it reads a drafter's
weights and resolved config and never changes them.
"""

from components.export.sglang import export_sglang, sglang_export
from components.export.vllm import (
           ExportError,
           export_vllm,
           vllm_export,
           vllm_method,
           vllm_speculative_config,
)

__all__ = ["ExportError", "export_sglang", "export_vllm", "sglang_export", "vllm_export", "vllm_method",
           "vllm_speculative_config"]
