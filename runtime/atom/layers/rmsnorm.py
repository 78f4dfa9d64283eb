"""RMSNorm computed in fp32, as Hugging Face Llama/Qwen do, cast back to the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual).

        The residual sum is taken in fp32 and rounded once: the same value as the model's
        dtype add, but written so that Inductor fuses it into this norm's kernel rather than
        into the preceding matmul as an addmm (which costs a copy of the residual and a
        slower GEMM variant per layer at decode sizes).
        """
        if residual is None:
            return self._norm(x)
        summed = (x.float() + residual.float()).to(x.dtype)
        return self._norm(summed), summed
