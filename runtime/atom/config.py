"""Engine configuration: compilation levels, CUDA-graph modes, and the serving Config.

Names, defaults and the level-3 setup in Config.__post_init__ follow the ATOM compilation
guide; every invalid value raises ValueError naming the field and what is allowed.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

from atom.compilation.levels import CompilationLevel, CUDAGraphMode, default_capture_sizes  # noqa: F401 - the guide imports them from here
from atom.lora.config import LoRAConfig

logger = logging.getLogger(__name__)

DEFAULT_SPLITTING_OPS = ["aiter.unified_attention_with_output", "aiter.mla_attention"]
CAPTURE_SIZES_KEYWORD = "cudagraph_capture_sizes"
DTYPES = ("bfloat16", "float16", "float32", "auto")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# --quantization and --kv-cache-dtype (atom.quantization): FP8 weights, an FP8 KV cache.
QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
ROLES = ("unified", "prefill", "decode")


def _check_sizes(name: str, sizes: Any, allow_keyword: bool = False) -> None:
    if not isinstance(sizes, (list, tuple)):
        raise ValueError(f"{name} must be a list of positive integers, got {sizes!r}")
    for s in sizes:
        if allow_keyword and s == CAPTURE_SIZES_KEYWORD:
            continue
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            extra = f' or the string "{CAPTURE_SIZES_KEYWORD}"' if allow_keyword else ""
            raise ValueError(f"{name} entries must be positive integers (>= 1){extra}, got {s!r}")


@dataclass
class CompilationConfig:
    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: list[int] | None = None
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [512])
    cudagraph_mode: CUDAGraphMode | None = None
    splitting_ops: list[str] | None = None
    cudagraph_copy_inputs: bool = False
    use_inductor: bool = True
    compile_sizes: list[int | str] | None = None
    inductor_compile_config: dict = field(default_factory=dict)
    # TR_HYBRID prefill token buckets above the capture sizes, up to max_num_batched_tokens
    # (atom.cudagraph.buckets; None: its default ladder, []: none). Graphs, not compiled
    # code: left out of the cache hash.
    prefill_token_sizes: list[int] | None = None
    debug_dump_path: str = ""
    cache_dir: str = ""
    # Filled at run time, not configuration (excluded from the cache hash).
    traced_files: set[str] = field(default_factory=set, repr=False, compare=False)
    local_cache_dir: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        self.level = int(CompilationLevel.parse(self.level))
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.cudagraph_capture_sizes is not None:
            _check_sizes("compilation_config.cudagraph_capture_sizes", self.cudagraph_capture_sizes)
            self.cudagraph_capture_sizes = list(self.cudagraph_capture_sizes)
        _check_sizes("compilation_config.cuda_graph_sizes", self.cuda_graph_sizes)
        if len(self.cuda_graph_sizes) == 0:
            raise ValueError("compilation_config.cuda_graph_sizes must hold at least one size")
        self.cuda_graph_sizes = list(self.cuda_graph_sizes)
        if self.prefill_token_sizes is not None:
            _check_sizes("compilation_config.prefill_token_sizes", self.prefill_token_sizes)
            self.prefill_token_sizes = list(self.prefill_token_sizes)
        if self.compile_sizes is not None:
            _check_sizes("compilation_config.compile_sizes", self.compile_sizes, allow_keyword=True)
            self.compile_sizes = list(self.compile_sizes)
        if self.splitting_ops is not None:
            if not isinstance(self.splitting_ops, (list, tuple)) or not all(
                isinstance(op, str) and "." in op for op in self.splitting_ops
            ):
                raise ValueError(
                    'compilation_config.splitting_ops must be a list of "namespace.op" names, '
                    f"got {self.splitting_ops!r}"
                )
            self.splitting_ops = list(self.splitting_ops)
        if not isinstance(self.inductor_compile_config, dict):
            raise ValueError(
                "compilation_config.inductor_compile_config must be a dict of Inductor options, "
                f"got {self.inductor_compile_config!r}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompilationConfig:
        """From JSON-like keys (snake_case or camelCase); unknown keys are refused."""
        known = {f.name for f in fields(cls) if f.init and f.name not in ("traced_files", "local_cache_dir")}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            name = _snake(key)
            if name not in known:
                raise ValueError(
                    f"compilation_config has no field {key!r}; allowed: {', '.join(sorted(known))}"
                )
            kwargs[name] = value
        return cls(**kwargs)

    def set_splitting_ops_for_v1(self) -> None:
        """Piecewise compilation splits at the attention ops unless the user chose others."""
        if self.splitting_ops is None:
            self.splitting_ops = list(DEFAULT_SPLITTING_OPS)

    def init_with_cudagraph_sizes(self, cudagraph_capture_sizes: list[int]) -> None:
        """Fix the final capture sizes and expand "cudagraph_capture_sizes" in compile_sizes."""
        self.cudagraph_capture_sizes = sorted(set(cudagraph_capture_sizes))
        sizes: set[int] = set()
        for s in self.compile_sizes or []:
            if s == CAPTURE_SIZES_KEYWORD:
                sizes.update(self.cudagraph_capture_sizes)
            else:
                sizes.add(int(s))
        self.compile_sizes = sorted(sizes)

    @property
    def max_capture_size(self) -> int:
        return max(self.cudagraph_capture_sizes or [0])

    def hash_factors(self) -> dict[str, Any]:
        """What changes compiled code; paths and run-time fields are left out on purpose."""
        skip = {"cache_dir", "debug_dump_path", "traced_files", "local_cache_dir",
                "prefill_token_sizes"}
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, CUDAGraphMode) else value
        return out


def _snake(name: str) -> str:
    out = []
    for ch in name:
        if ch.isupper():
            out.append("_" + ch.lower())
        else:
            out.append(ch)
    return "".join(out).lstrip("_")


# ---- speculative decoding (`--speculative-config`, vLLM's JSON shape where it fits) ----


class SpecMethod(enum.StrEnum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


_FIELDS = {
    SpecMethod.NGRAM: {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    SpecMethod.DRAFT_MODEL: {"method", "num_speculative_tokens", "model"},
}


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """k draft tokens per request per step, proposed by `method`, verified by the target."""

    method: SpecMethod
    num_speculative_tokens: int
    model: str | None = None  # draft_model: a model directory or built-in shape (the target's own: self-draft)
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched against the earlier tokens
    prompt_lookup_max: int = 3  # ngram: longest suffix tried first

    def __post_init__(self) -> None:
        try:
            method = SpecMethod(self.method)
        except ValueError:
            allowed = ", ".join(m.value for m in SpecMethod)
            raise ValueError(
                f"speculative_config.method must be one of {allowed}, got {self.method!r}"
            ) from None
        object.__setattr__(self, "method", method)
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if method == SpecMethod.DRAFT_MODEL:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config.model is required for method draft_model "
                    "(a model directory or built-in shape; the target's own name self-drafts)"
                )
        else:
            lo = _positive("prompt_lookup_min", self.prompt_lookup_min)
            hi = _positive("prompt_lookup_max", self.prompt_lookup_max)
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
                )

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """From JSON keys (snake_case or camelCase); keys the method does not take are refused."""
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {data!r}")
        norm = {_snake(k): v for k, v in data.items()}
        if "method" not in norm:
            raise ValueError("speculative_config.method is required (ngram or draft_model)")
        try:
            method = SpecMethod(norm["method"])
        except ValueError:
            allowed = ", ".join(m.value for m in SpecMethod)
            raise ValueError(
                f"speculative_config.method must be one of {allowed}, got {norm['method']!r}"
            ) from None
        if "num_speculative_tokens" not in norm:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        extra = sorted(set(norm) - _FIELDS[method])
        if extra:
            raise ValueError(
                f"speculative_config has no field {extra[0]!r} for method {method.value}; "
                f"allowed: {', '.join(sorted(_FIELDS[method]))}"
            )
        return cls(**norm)

    def check_serving(self, *, role: str, block_size: int, max_rows: int, max_bucket_seqs: int) -> None:
        """Refuse combinations the engine cannot serve (ValueError naming the field)."""
        if role == "prefill":
            raise ValueError(
                "speculative_config is not allowed with role=prefill: a prefill instance samples "
                "one token per request and never decodes"
            )
        rows = self.k + 1
        if rows > block_size:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={self.k}: k + 1 = {rows} query rows "
                f"exceed block_size={block_size} (a captured bucket's dummy rows live in one block)"
            )
        # The largest captured verify bucket must fit one step's rows (0: nothing captured).
        if rows * max_bucket_seqs > max_rows:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={self.k}: the largest bucket "
                f"({max_bucket_seqs} requests x {rows} rows = {rows * max_bucket_seqs}) exceeds "
                f"max_num_batched_tokens={max_rows}"
            )

    def hash_factors(self) -> dict[str, Any]:
        """Different k means different captured buckets; the draft model is its own compile."""
        return {"method": self.method.value, "k": self.k, "model": self.model}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method.value, "num_speculative_tokens": self.k}
        if self.method == SpecMethod.DRAFT_MODEL:
            out["model"] = self.model
        else:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out


class ModelLimits(NamedTuple):
    """Config's lengths once the model is known (Config.finalize_model_len)."""

    max_model_len: int
    max_num_batched_tokens: int


@dataclass
class Config:
    # directory with config.json, a GGUF file (or directory holding one), a packaged model's
    # name (smollm2-135m-instruct) or a built-in shape name
    model: str = "tiny-llama"
    load_format: str = "auto"  # auto (GGUF for a GGUF model) | safetensors | dummy
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | auto
    served_model_name: str | None = None
    max_num_seqs: int = 512
    max_model_len: int | None = None  # default: model's max_position_embeddings capped at 4096
    max_num_batched_tokens: int | None = None  # default: max(max_model_len, 2048)
    block_size: int = 16
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None  # CPU: size of the KV cache in blocks (default 512)
    enforce_eager: bool = False
    # Launch each step before reading the last one's tokens (LLMEngine.step); False: every
    # step ends with its tokens on the host.
    async_scheduling: bool = True
    # Reuse the KV blocks of cached prompt prefixes (atom.engine.block_manager). Not a compile
    # or capture input: the same compiled code and graphs serve both settings.
    enable_prefix_caching: bool = True
    capture_sizes: list[int] | None = None  # computed in __post_init__
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    seed: int = 0
    role: str = "unified"
    device: str | None = None  # default: "cuda" if available else "cpu"
    # Speculative decoding (atom.spec_decode): None = off; a dict is parsed (--speculative-config).
    speculative_config: SpeculativeConfig | None = None
    # Tensor parallelism (atom.distributed): ranks of one host; enters the compile-cache key.
    tensor_parallel_size: int = 1
    # Multi-LoRA (atom.lora): None = off (the model path has no LoRA op); a dict is parsed.
    lora_config: LoRAConfig | None = None
    # FP8 (atom.quantization): "fp8" quantizes the decoder's projection weights at load;
    # kv_cache_dtype "fp8" stores the KV cache in float8_e4m3fn. Both enter the compile key.
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    # Set when level 3 took its default graph mode (no mode configured): the model runner then
    # consults atom.cudagraph.mode_defaults with the model's size. Not configuration.
    graph_mode_by_size: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.compilation_config, dict):
            self.compilation_config = CompilationConfig.from_dict(self.compilation_config)
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if isinstance(self.lora_config, dict):
            self.lora_config = LoRAConfig.from_dict(self.lora_config)
        if self.lora_config is not None and self.speculative_config is not None:
            raise ValueError("lora_config and speculative_config cannot be combined (drafts "
                             "would run without the adapters)")
        self._validate_serving_fields()
        if self.served_model_name is None:
            self.served_model_name = self.model
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        cc = self.compilation_config

        if self.enforce_eager:
            # The guide: enforce_eager skips all compilation and CUDA graphs.
            cc.level = int(CompilationLevel.NO_COMPILATION)
            cc.cudagraph_mode = CUDAGraphMode.NONE
            cc.init_with_cudagraph_sizes([])
            self.capture_sizes = []
            return

        if cc.level == CompilationLevel.PIECEWISE:
            cc.set_splitting_ops_for_v1()
            if cc.cudagraph_mode is None:
                cc.cudagraph_mode = CUDAGraphMode.TR_HYBRID
                # the model runner may pick another by size (atom.cudagraph.mode_defaults)
                self.graph_mode_by_size = True
        elif cc.cudagraph_mode is None:
            cc.cudagraph_mode = CUDAGraphMode.NONE
        if not cc.use_cudagraph:
            if cc.cudagraph_mode != CUDAGraphMode.NONE:
                logger.info("use_cudagraph=False: cudagraph_mode %s -> NONE", cc.cudagraph_mode)
            cc.cudagraph_mode = CUDAGraphMode.NONE
            self.graph_mode_by_size = False  # no graphs: nothing for the size table to pick

        # Nothing is captured under NONE: sizes are ignored rather than refused (DESIGN.md).
        sizes = [] if cc.cudagraph_mode == CUDAGraphMode.NONE else self._cudagraph_sizes()
        self.capture_sizes = sizes
        cc.init_with_cudagraph_sizes(sizes)

    def _validate_serving_fields(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive("max_num_seqs")
        positive("tensor_parallel_size")
        positive("block_size")
        positive("max_model_len", allow_none=True)
        positive("max_num_batched_tokens", allow_none=True)
        positive("num_kv_blocks", allow_none=True)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization != "none" and self.lora_config is not None:
            # LoRA's deltas run on the bf16 projections, which FP8 frees after quantizing.
            raise ValueError("quantization and lora_config cannot be combined")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        spec = self.speculative_config
        if spec is not None:
            if not isinstance(spec, SpeculativeConfig):
                raise ValueError(
                    "speculative_config must be a SpeculativeConfig or a dict of its fields, "
                    f"got {type(spec).__name__}"
                )
            if self.role == "prefill":
                spec.check_serving(role=self.role, block_size=self.block_size, max_rows=0,
                                   max_bucket_seqs=0)
        if not isinstance(self.compilation_config, CompilationConfig):
            raise ValueError(
                "compilation_config must be a CompilationConfig or a dict of its fields, "
                f"got {type(self.compilation_config).__name__}"
            )

    def _cudagraph_sizes(self) -> list[int]:
        """capture_sizes from cudagraph_capture_sizes, else from cuda_graph_sizes (guide)."""
        cc = self.compilation_config
        if cc.cudagraph_capture_sizes is not None:
            sizes, source = list(cc.cudagraph_capture_sizes), "compilation_config.cudagraph_capture_sizes"
        elif len(cc.cuda_graph_sizes) == 1:
            # The generated pattern is clamped: the scheduler never runs more than max_num_seqs.
            sizes = [s for s in default_capture_sizes(cc.cuda_graph_sizes[0]) if s <= self.max_num_seqs]
            source = "compilation_config.cuda_graph_sizes"
        else:
            sizes, source = list(cc.cuda_graph_sizes), "compilation_config.cuda_graph_sizes"
        too_big = [s for s in sizes if s > self.max_num_seqs]
        if too_big:
            raise ValueError(
                f"{source} entries must be between 1 and max_num_seqs={self.max_num_seqs}, "
                f"got {too_big}"
            )
        return sorted(set(sizes))

    def finalize_model_len(self, max_position_embeddings: int) -> ModelLimits:
        """Fill the length defaults once the model's config is known (docs/architecture.md)."""
        if self.max_model_len is None:
            self.max_model_len = min(int(max_position_embeddings), 4096)
        elif self.max_model_len > max_position_embeddings:
            # The rotary tables end there: a longer sequence would index past them mid-request.
            raise ValueError(
                f"max_model_len={self.max_model_len} is above the model's "
                f"max_position_embeddings={max_position_embeddings}"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 2048)
        if self.speculative_config is not None:
            self.speculative_config.check_serving(
                role=self.role, block_size=self.block_size, max_rows=self.max_num_batched_tokens,
                max_bucket_seqs=max(self.capture_sizes or [0]),
            )
        return self.model_limits()

    def model_limits(self) -> ModelLimits:
        """The lengths finalize_model_len filled (a RuntimeError before it has run)."""
        if self.max_model_len is None or self.max_num_batched_tokens is None:
            raise RuntimeError("Config.finalize_model_len has not run")
        return ModelLimits(self.max_model_len, self.max_num_batched_tokens)

    def model_hash_factors(self) -> dict[str, Any]:
        """Config-side model identity for the compile-cache hash (the module adds its shapes)."""
        return {"model": self.model, "dtype": self.dtype}

    def compile_hash_factors(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compilation_config": self.compilation_config.hash_factors(),
            "model": self.model_hash_factors(),
        }
        if self.speculative_config is not None:
            # Verify buckets of k + 1 rows are different captured (and compiled) work.
            out["speculative"] = self.speculative_config.hash_factors()
        if self.lora_config is not None:
            # The LoRA path is other traced code with other buffers (left out when off).
            out["lora"] = self.lora_config.hash_factors()
        if self.tensor_parallel_size > 1:
            # Shard shapes and collectives are other compiled code: never shared across TP
            # sizes. Left out at 1 so single-GPU caches keep their key.
            out["tensor_parallel_size"] = self.tensor_parallel_size
        # FP8 weights and an FP8 cache are other compiled code and other captured kernels;
        # left out at the defaults so existing caches keep their key.
        if self.quantization != "none":
            out["quantization"] = self.quantization
        if self.kv_cache_dtype != "auto":
            out["kv_cache_dtype"] = self.kv_cache_dtype
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("graph_mode_by_size", None)  # derived at run time, not a field to set
        cc = data["compilation_config"]
        cc.pop("traced_files", None)
        cc.pop("local_cache_dir", None)
        if self.compilation_config.cudagraph_mode is not None:
            cc["cudagraph_mode"] = self.compilation_config.cudagraph_mode.name
        if self.speculative_config is not None:
            data["speculative_config"] = self.speculative_config.to_dict()
        return data
