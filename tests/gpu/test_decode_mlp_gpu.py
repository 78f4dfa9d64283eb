"""The one-launch decode MLP (atom.kernels.triton_decode_mlp, aiter::norm_mlp at one row) on
CUDA in bf16: bit-identical to the two launches it replaces (gate_up with norm and gate, then
down_proj with the residual), launched early or not, again and again (the barrier's counters
re-arm), inside a CUDA graph replayed over new inputs, and on shapes whose gate_up and
down_proj strip counts differ."""

from __future__ import annotations

import pytest
import torch

import atom.layers.norm_linear  # noqa: F401 - registers the ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]


def _weights(gen: torch.Generator, hidden: int, inter: int, bias: bool
             ) -> tuple[torch.Tensor, ...]:
    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    norm_w = 1 + randn(hidden, scale=0.1)
    gate_up = randn(2 * inter, hidden, scale=hidden ** -0.5)
    down = randn(hidden, inter, scale=inter ** -0.5)
    gate_up_b = randn(2 * inter, scale=0.1) if bias else None
    down_b = randn(hidden, scale=0.1) if bias else None
    return norm_w, gate_up, gate_up_b, down, down_b


def _two_launches(x: torch.Tensor, norm_w: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_b: torch.Tensor | None, down: torch.Tensor,
                  down_b: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
    from atom.kernels import triton_norm_gemv as kernels

    act = kernels.gemv(x, gate_up, gate_up_b, norm_weight=norm_w, eps=1e-5, gated=True)
    return kernels.gemv(act, down, down_b, residual=res)


def _applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    from atom.kernels import triton_decode_mlp as fused

    if not fused.decode_mlp_applies(x, gate_up, down):
        pytest.skip("the one-launch MLP needs sm_90 (programmatic launch) and an SM per strip")


# Llama-3.2-1B (128 strips each), Qwen3-0.6B-like (48 gate_up and 64 down_proj strips), and
# an intermediate size that leaves the last gate_up strip partial.
@pytest.mark.parametrize(("hidden", "inter"), [(2048, 8192), (1024, 3072), (1024, 3000)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_mlp_is_bit_identical_to_two_launches(hidden: int, inter: int, bias: bool,
                                                     overlap: bool) -> None:
    from atom.kernels import triton_decode_mlp as fused

    gen = torch.Generator(device="cuda").manual_seed(hidden + inter + bias)
    norm_w, gate_up, gate_up_b, down, down_b = _weights(gen, hidden, inter, bias)
    for call in range(3):  # the counters must be back at zero for each next launch
        x = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
        res = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
        _applies(x, gate_up, down)
        out = fused.decode_mlp(x, norm_w, 1e-5, gate_up, gate_up_b, down, down_b, res, overlap)
        ref = _two_launches(x, norm_w, gate_up, gate_up_b, down, down_b, res)
        assert torch.equal(out, ref), (call, (out.float() - ref.float()).abs().max())
    assert not fused._sync_counters(x.device).any()


def test_norm_mlp_op_in_a_cuda_graph_replays_over_new_inputs() -> None:
    """16 layers' MLPs back to back, recorded once and replayed with new inputs: each replay
    equals the two-launch path; the op takes the fused launch at one row and the two-launch
    path at two rows (both recorded)."""
    from atom.kernels import triton_decode_mlp as fused

    hidden, inter, layers = 2048, 8192, 16
    gen = torch.Generator(device="cuda").manual_seed(7)
    weights = [_weights(gen, hidden, inter, False) for _ in range(layers)]

    def forward(h: torch.Tensor) -> torch.Tensor:
        for norm_w, gate_up, gate_up_b, down, down_b in weights:
            h = torch.ops.aiter.norm_mlp(h, norm_w, 1e-5, gate_up, gate_up_b, down, down_b, h,
                                         True)
        return h

    def reference(h: torch.Tensor) -> torch.Tensor:
        for w in weights:
            h = _two_launches(h, w[0], *w[1:], h)
        return h

    for rows in (1, 2):
        static_in = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
        _applies(static_in[:1], weights[0][1], weights[0][3])
        forward(static_in)  # compiled before recording
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = forward(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        for replay in range(4):
            static_in.copy_(torch.randn(rows, hidden, generator=gen, device="cuda"))
            graph.replay()
            assert torch.equal(static_out, reference(static_in.clone())), (rows, replay)
        assert not fused._sync_counters(static_in.device).any()
