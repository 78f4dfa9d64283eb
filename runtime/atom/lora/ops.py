"""The batched LoRA delta: every row's own adapter, all adapters in one step.

A per-row gather of A and B (bgmv) reads rows x rank x (in + out) values, which at prefill
sizes is gigabytes. Here each row is multiplied by every resident adapter's A at once (one
matmul with max_loras x rank columns, a few percent of the base projection's), the columns of
adapters other than the row's own are zeroed by a mask built from the row's slot, and one
matmul with the stacked B sums the row's own update. Every shape is static, so compiled code
and recorded graphs serve any mix of adapters; slot 0 (no adapter) has no columns at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """x [T, in]; a [S, K, in] and b [S, K, out] for slots 1..S (scaling folded into b);
    slots [T] each row's slot (0: none); ids [S] = 1..S. Returns [T, out]."""
    s, k, width = a.shape
    t = x.shape[0]
    xa = F.linear(x, a.reshape(s * k, width)).view(t, s, k)
    own = (slots[:t, None] == ids[None, :]).to(x.dtype)  # [T, S]: 1 at the row's adapter
    return (xa * own[:, :, None]).view(t, s * k) @ b.reshape(s * k, b.shape[2])
