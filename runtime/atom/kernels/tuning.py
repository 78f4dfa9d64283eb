"""Every tuning switch of the decode kernels, each with the measurement that set it.

The kernels read these at launch time (`tuning.NAME`), so a benchmark may set one to compare
an alternative in one process (bench/profile_decode.py --compare). Figures are wall
microseconds per decode step of Llama-3.2-1B at level 3 FULL on one H200, unless noted.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- projections (GEMV)

# Above this many rows the matmul is no longer a weight stream and cuBLAS does it better, so
# the Triton GEMV kernels take at most this many rows (decode batches).
GEMV_MAX_ROWS = 16

# Up to this many rows an overlappable projection (qkv) runs the preloading kernel, which
# holds its weight strip in registers while the kernel before it runs: 30 us a step faster at
# batch 1 (900.8 against 930.6), while at 8 rows it needs 202 registers and the step took
# 1421.8 against 1020.7. 0: the tiled kernel.
ROW_GEMV_MAX_ROWS = 1
# Weight bytes a preloading program holds (16 whole rows of 2048 in bf16), and its warps.
ROW_STRIP_BYTES = 64 * 1024
ROW_WARPS = 8

# Tiled projections launched early (programmatic dependent launch) at up to this many rows:
# at one row every projection gains its launch's start-up (880.6 against 903.7), while every
# tiled projection early at 8 rows lost 165 us (1187.2 against 1021.3).
TILED_PDL_MAX_ROWS = 1
# Up to this many rows only launches of at most one program per SM are started early, spread
# one per SM: batch 8 969.3 against 1012.6, batch 16 1019.4 against 1059.2 (an early launch
# placed while the kernel before it runs packs onto half the SMs otherwise).
ONE_WAVE_PDL_MAX_ROWS = GEMV_MAX_ROWS
# A one-wave early launch with K of at least this many loads its first weight tile before its
# wait, which only down_proj has: 8 us a step faster at batch 8 (956.1 against 964.4), while
# on every plain early launch (qkv and o_proj too) it lost (968.9).
TILED_PRELOAD_MIN_K = 4096
# A one-wave early launch whose strips leave SMs idle takes fewer rows a program, so qkv at
# 2-16 rows runs 128 strips of 24 instead of 96 of 32 (96 left 36 of the 132 SMs without
# weights): batch 8 947.0 against 952.8.
EVEN_STRIPS = True

# --------------------------------------------------------------------------- decode attention

# Decode attention launched early beside the qkv projection (sm_90 on): 25 us a step faster
# at batch 1 and 36 us at batch 8 (931.0 against 956.0, 1022.5 against 1058.8).
DECODE_PDL = True
# Programs the split decode attention aims for: 128 targets matched 512 at batch 1 (874.2
# against 875.3), but batch 8 took 1016.6 against 975.5 with fewer splits, and 64 targets
# lost at both batch sizes (882.7, 1034.0).
DECODE_TARGET_PROGRAMS = 512
# Most splits a row's keys are dealt to: with one split (no combine) batch 1 took 984.6
# against 875.3, with four 904.8; the combine costs far less than a long walk in one program.
DECODE_MAX_SPLITS = 128
# Keys per loop step (4 cache blocks of 16): tiles of 32 took 911.1 against 862.1 at batch 1
# and 960.3 against 952.5 at batch 8.
DECODE_TILE_N = 64

# --------------------------------------------------------------------------- attention + o_proj

# The decode kernel stores this step's keys and values itself: 29.5 us a step faster at
# batch 1 (977.0 against 1006.5 with the store kernel first) and 16 fewer launches.
FUSED_DECODE_STORE = True
# o_proj shares the decode attention's launch at batch 1: 945.8 against 971.8 for o_proj as
# its own GEMV launch.
FUSED_DECODE_O_PROJ = True
# Rows the fused attention + o_proj launch takes: with 2 to 4 rows (a loop over them after
# the wait) it was slower than two launches.
FUSED_O_PROJ_ROWS = 1
# Weight bytes a fused projection program holds while it waits, and its warps: 16 rows at 8
# warps (154 registers, one program per SM) took 945.8 against 972.0 for 8 rows at 8 warps
# and 985.2 for 8 rows at 4 warps.
FUSED_O_PROJ_STRIP_BYTES = 64 * 1024
FUSED_O_PROJ_WARPS = 8
# The fused projection programs load their weights before waiting for the attention: without
# the preload the launch took 234.0 us a step against 190.8, slower than two launches.
FUSED_O_PROJ_PRELOAD = True
