"""The decoder layer's MLP at one decode row in one launch: RMSNorm -> gate_up -> SiLU(gate) * up
-> down_proj + residual.

As two launches (atom.kernels.triton_norm_gemv), down_proj's programs find room on an SM only
once gate_up's programs there have ended, and its weight stream starts only once the whole of
gate_up has ended and its launch's wait returns: each boundary leaves memory idle for a few
microseconds at batch 1 (bench/RESULTS.md, session 13). Here every program streams its strip
of gate_up, loads the first weight tile of its down_proj strip while the slower programs
finish theirs, meets the others at a grid barrier (an arrival counter: the activation is
complete), then streams the rest of its down_proj strip. Each strip runs the two-launch path's
own code (triton_norm_gemv._projection_strip), so the results are bit-identical to it.

The barrier needs every program resident at once: the launch has at most one program per SM
(the caller checks the SM count) and takes more than half an SM's shared memory, so no SM
holds two; programs that have arrived wait only for programs already placed or still to be
placed on SMs that other kernels leave, and no kernel after this one starts before all of
its programs have (programmatic launch releases dependents only once every program here has
started). The last program to finish re-arms the counters for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom.kernels import triton_norm_gemv
from atom.kernels.launch import programmatic_launch, sm_resources
from atom.kernels.triton_attention import _arrive
from atom.kernels.triton_norm_gemv import (
    SMEM_BUDGET,
    _projection_strip,
    _split_weights,
    _strip_rows,
    _wait_for,
)

# Decode rows the fused launch takes (1: batch-1 decode); 0 turns it off.
MAX_ROWS = 1
# gate_up strips of GATE_ROWS gate rows (and as many up rows) in K steps of GATE_K; down_proj
# strips of DOWN_ROWS rows in K steps of DOWN_K cut into DOWN_SPLIT slices (the two-launch
# path's one-wave tiles: triton_norm_gemv._config). Each K loop is pipelined as deep as
# SMEM_BUDGET allows for its own tiles: the two loops' buffers share the shared memory.
GATE_ROWS, GATE_K = 64, 64
DOWN_ROWS, DOWN_K, DOWN_SPLIT = 16, 1024, 4
WARPS = 4
# Shared memory for either loop's pipeline (they share it).
SMEM_BYTES = SMEM_BUDGET
# down_proj's first weight tile loaded before the barrier (False: after it).
PRELOAD_DOWN = False
# Launched early where the caller allows it (False: an ordinary launch). The kernel after it
# (the next layer's qkv, which loads its weights as soon as its programs are placed) is
# released as every program here passes the barrier ("barrier"), as each starts ("start"),
# or once all have ended (None).
EARLY = True
RELEASE_AT = "barrier"

_LINE = 32  # the arrival and finish counters a 128-byte line apart
_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync_counters(device: torch.device) -> torch.Tensor:
    """Arrivals and finished programs (elements 0 and _LINE), zero between launches; allocated
    once per device (before any capture) and kept: recorded graphs hold its address."""
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(2 * _LINE, dtype=torch.int32, device=device)
    return _SYNC[device]


@triton.jit
def _decode_mlp_kernel(x_ptr, nw_ptr, wgu_ptr, bgu_ptr, act_ptr, wd_ptr, bd_ptr, res_ptr, y_ptr,
                       sync_ptr, M, H, inter, eps, stride_x, stride_wgu, stride_act, stride_wd,
                       stride_r, stride_y, GATE_BIAS: tl.constexpr, DOWN_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr,
                       GATE_ROWS: tl.constexpr, GATE_K: tl.constexpr, DOWN_ROWS: tl.constexpr,
                       DOWN_K: tl.constexpr, DOWN_SPLIT: tl.constexpr,
                       GATE_STAGES: tl.constexpr, DOWN_STAGES: tl.constexpr,
                       PRECISION: tl.constexpr, PRELOAD: tl.constexpr, WAIT: tl.constexpr,
                       RELEASE: tl.constexpr, LINE: tl.constexpr, POLL_BY_LOAD: tl.constexpr):
    """Program pid: gate_up strip pid (if there is one) into act, down_proj's first tile, the
    barrier, down_proj strip pid (if there is one) into y."""
    if RELEASE == "start":
        gdc_launch_dependents()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if WAIT:
        gdc_wait()
    offs_g, g_mask = _strip_rows(pid, inter, GATE_ROWS, GATE_ROWS)
    if pid * GATE_ROWS < inter:
        _projection_strip(offs_g, g_mask, x_ptr, nw_ptr, wgu_ptr, bgu_ptr, act_ptr, act_ptr, M,
                          H, eps, stride_x, stride_wgu, 0, stride_act, inter, 0.0, True, True,
                          GATE_BIAS, False, BLOCK_M, GATE_ROWS, GATE_K, 1, PRECISION, False,
                          GATE_STAGES)
    offs_d, d_mask = _strip_rows(pid, H, DOWN_ROWS, DOWN_ROWS)
    w0 = 0.0
    if PRELOAD:  # weights only: no program of this launch writes them
        w0 = _split_weights(wd_ptr, offs_d, d_mask, 0, inter, stride_wd, DOWN_K, DOWN_SPLIT)
    _arrive(sync_ptr)  # this program's act columns are written
    _wait_for(sync_ptr, programs, POLL_BY_LOAD)  # every program's are
    if RELEASE == "barrier":
        gdc_launch_dependents()
    if pid * DOWN_ROWS < H:
        _projection_strip(offs_d, d_mask, act_ptr, act_ptr, wd_ptr, bd_ptr, res_ptr, y_ptr, M,
                          inter, 0.0, stride_act, stride_wd, stride_r, stride_y, 0, w0, False,
                          False, DOWN_BIAS, True, BLOCK_M, DOWN_ROWS, DOWN_K, DOWN_SPLIT,
                          PRECISION, PRELOAD, DOWN_STAGES)
    finished = tl.atomic_add(sync_ptr + LINE, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:  # every program is past the barrier: re-armed
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + LINE, 0)


def decode_mlp_programs(hidden: int, inter: int) -> int:
    """Programs of the fused launch: one per gate_up strip or down_proj strip, whichever more."""
    return max(triton.cdiv(inter, GATE_ROWS), triton.cdiv(hidden, DOWN_ROWS))


def _stage_bytes(rows: int, elem: int) -> tuple[int, int]:
    """Shared-memory bytes of one pipeline stage of the gate_up loop and of the down_proj loop
    (the activation rows' tile, padded to the dot's 16, and the weights')."""
    block_m = max(16, triton.next_power_of_2(rows))
    return (block_m + 2 * GATE_ROWS) * GATE_K * elem, (block_m + DOWN_ROWS) * DOWN_K * elem


def decode_mlp_stages(rows: int, elem: int, smem_per_sm: int) -> tuple[int, int] | None:
    """Pipeline depth of the gate_up and down_proj loops: the most stages within
    SMEM_BYTES each (a loop holds stages - 1 tiles in flight), if the deeper loop then takes
    more than half an SM's shared memory (one program per SM); else None."""
    stages = [SMEM_BYTES // stage for stage in _stage_bytes(rows, elem)]
    held = max((n - 1) * stage for n, stage in zip(stages, _stage_bytes(rows, elem), strict=True))
    return (stages[0], stages[1]) if min(stages) >= 2 and held > smem_per_sm // 2 else None


def decode_mlp_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether decode_mlp takes these rows and weights on this device."""
    if not (x.is_cuda and 0 < x.shape[0] <= MAX_ROWS and programmatic_launch(x.device)):
        return False
    sms, smem = sm_resources(x.device)
    hidden, inter = down.shape[0], down.shape[1]
    return (decode_mlp_programs(hidden, inter) <= sms
            and decode_mlp_stages(x.shape[0], x.element_size(), smem) is not None)


def decode_mlp(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
               gate_up_bias: torch.Tensor | None, down: torch.Tensor,
               down_bias: torch.Tensor | None, residual: torch.Tensor,
               overlap: bool = False) -> torch.Tensor:
    """residual + down(SiLU(gate) * up of gate_up(RMSNorm(x))) in one launch, for the rows
    decode_mlp_applies to. overlap: the launch may start before the kernel before it ends
    (triton_norm_gemv.gemv's)."""
    m, hidden = x.shape
    inter = down.shape[1]
    assert gate_up.shape == (2 * inter, hidden) and down.shape == (hidden, inter)
    assert residual.shape == (m, hidden) and residual.stride(-1) == 1
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    stages = decode_mlp_stages(m, x.element_size(), sm_resources(x.device)[1])
    assert stages is not None
    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    _decode_mlp_kernel[(decode_mlp_programs(hidden, inter),)](
        x, norm_weight, gate_up, gate_up_bias if gate_up_bias is not None else gate_up, act,
        down, down_bias if down_bias is not None else down, residual, y,
        _sync_counters(x.device), m, hidden, inter, eps, x.stride(0), gate_up.stride(0),
        act.stride(0), down.stride(0), residual.stride(0), y.stride(0),
        GATE_BIAS=gate_up_bias is not None, DOWN_BIAS=down_bias is not None, BLOCK_M=max(16, triton.next_power_of_2(m)),
        GATE_ROWS=GATE_ROWS, GATE_K=GATE_K, DOWN_ROWS=DOWN_ROWS, DOWN_K=DOWN_K,
        DOWN_SPLIT=DOWN_SPLIT, GATE_STAGES=stages[0], DOWN_STAGES=stages[1], PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PRELOAD=PRELOAD_DOWN, WAIT=overlap and EARLY, RELEASE=RELEASE_AT, LINE=_LINE,
        POLL_BY_LOAD=triton_norm_gemv.POLL_BY_LOAD, launch_pdl=overlap and EARLY,
        num_warps=WARPS)
    return y
