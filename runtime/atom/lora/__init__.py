"""Multi-LoRA serving: PEFT adapters applied per row, batched across adapters in one step.

- config: LoRAConfig (--lora-modules, --max-loras, --max-lora-rank);
- adapter: reading a PEFT adapter directory (adapter_config.json + adapter_model.safetensors);
- weights: the static stacked buffers a decoder layer reads, slot 0 meaning "no adapter";
- ops: the batched LoRA delta (every row's adapter in one shrink and one expand matmul);
- manager: which adapter sits in which slot, each step's per-row slots, loads and unloads.
"""

from atom.lora.config import LoRAConfig, parse_lora_module

__all__ = ["LoRAConfig", "parse_lora_module"]
