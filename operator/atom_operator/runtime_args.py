"""Effective per-role settings and the runtime command line (DESIGN.md's contract).

Pure functions of the spec. `atom.cli.args.build_parser()` parses every rendered line
(tests/operator/test_runtime_args.py).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from atom_operator import naming
from atom_operator.model_spec import ModelSource
from atom_operator.spec import AtomDeploymentSpec, Compilation, CompilationOverride

DEFAULT_CUDA_GRAPH_SIZES = [512]


def roles(spec: AtomDeploymentSpec) -> list[str]:
    """Runtime roles (the router is not a runtime role)."""
    return [naming.PREFILL, naming.DECODE] if spec.disaggregation else [naming.UNIFIED]


def role_replicas(spec: AtomDeploymentSpec, role: str) -> int:
    if spec.disaggregation is None:
        return 1 if spec.replicas is None else spec.replicas
    if role == naming.ROUTER:
        return spec.disaggregation.router.replicas
    return getattr(spec.disaggregation, role).replicas


def tensor_size(spec: AtomDeploymentSpec, role: str) -> int:
    """The role's tensor-parallel size: its own parallelism, else the shared one, else 1."""
    if spec.disaggregation is not None and role in (naming.PREFILL, naming.DECODE):
        own = getattr(spec.disaggregation, role).parallelism
        if own is not None and own.tensor is not None:
            return own.tensor
    return spec.parallelism.tensor or 1


def kv_transport(spec: AtomDeploymentSpec) -> str | None:
    """The P/D pair's --kv-transport (None when not disaggregated)."""
    return spec.disaggregation.kv_transport if spec.disaggregation is not None else None


def effective_compilation(spec: AtomDeploymentSpec, role: str) -> Compilation:
    """The shared compilation with the role's overrides; decode defaults to FULL_DECODE_ONLY."""
    merged = spec.compilation.model_dump()
    override: CompilationOverride | None = None
    if spec.disaggregation is not None and role in (naming.PREFILL, naming.DECODE):
        override = getattr(spec.disaggregation, role).compilation
        if role == naming.DECODE:
            merged["cudagraph_mode"] = "FULL_DECODE_ONLY"
    if override is not None:
        merged.update(override.model_dump(exclude_none=True))
    if spec.device == "cpu":  # no CUDA graphs on a CPU (CEL refuses any other explicit mode)
        merged["cudagraph_mode"] = "NONE"
    return Compilation(**merged)


def graph_mode(spec: AtomDeploymentSpec, comp: Compilation) -> str:
    """The mode the runtime will run: unset means its level-3 default (TR_HYBRID), else NONE."""
    if spec.engine.enforce_eager:
        return "NONE"
    if comp.cudagraph_mode:
        return comp.cudagraph_mode
    return "TR_HYBRID" if comp.level == 3 else "NONE"


def capture_sizes(spec: AtomDeploymentSpec, comp: Compilation) -> list[int]:
    """Batch sizes the pod will capture (the guide's rule); none when no graph mode."""
    if graph_mode(spec, comp) == "NONE":
        return []
    if comp.cudagraph_capture_sizes:
        sizes = comp.cudagraph_capture_sizes
    else:
        base = comp.cuda_graph_sizes or DEFAULT_CUDA_GRAPH_SIZES
        sizes = list(range(1, 9)) + list(range(16, base[0] + 1, 16)) if len(base) == 1 else base
    return sorted({s for s in sizes if s <= spec.engine.max_num_seqs})


def _compilation_config_json(comp: Compilation) -> dict[str, Any]:
    """Fields without their own flag go through --compilation-config (CompilationConfig names)."""
    extra: dict[str, Any] = {}
    if comp.splitting_ops is not None:
        extra["splitting_ops"] = comp.splitting_ops
    if comp.compile_sizes is not None:
        extra["compile_sizes"] = comp.compile_sizes
    if not comp.use_inductor:
        extra["use_inductor"] = False
    if comp.inductor_compile_config:
        extra["inductor_compile_config"] = comp.inductor_compile_config
    return extra


def render_args(
    spec: AtomDeploymentSpec,
    role: str,
    *,
    cache_dir: str | None,
    command: str = "serve",
) -> list[str]:
    """Arguments after `atom-runtime` for one role; sizes are dropped when no graph is captured."""
    comp = effective_compilation(spec, role)
    model = spec.model
    args = [command, "--model", model_argument(model)]
    args += ["--load-format", model.load_format, "--dtype", model.dtype]
    # Only when set: the runtime's defaults, so existing pods keep their arguments.
    if spec.quantization != "none":
        args += ["--quantization", spec.quantization]
    if spec.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if model.name and model.name != model_argument(model):
        args += ["--served-model-name", model.name]
    args += ["--host", "0.0.0.0", "--port", str(naming.HTTP_PORT)]
    args += ["--max-num-seqs", str(spec.engine.max_num_seqs)]
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if spec.engine.enforce_eager:
        args.append("--enforce-eager")
    tensor = tensor_size(spec, role)
    if tensor > 1:  # 1 is the runtime's default: existing pods keep their arguments
        args += ["--tensor-parallel-size", str(tensor)]
    if not spec.prefix_caching:  # on by default in the runtime
        args.append("--no-enable-prefix-caching")
    args += ["--level", str(comp.level)]
    if comp.cudagraph_mode is not None:
        args += ["--cudagraph-mode", comp.cudagraph_mode]
    if comp.cudagraph_mode != "NONE":
        if comp.cudagraph_capture_sizes:
            args += ["--cudagraph-capture-sizes", *map(str, sorted(comp.cudagraph_capture_sizes))]
        elif comp.cuda_graph_sizes:
            args += ["--cuda-graph-sizes", *map(str, comp.cuda_graph_sizes)]
    extra = _compilation_config_json(comp)
    if extra:
        args += ["--compilation-config", json.dumps(extra, sort_keys=True, separators=(",", ":"))]
    if cache_dir:
        args += ["--compile-cache-dir", cache_dir]
    spec_json = speculative_json(spec, role)
    if spec_json is not None:
        args += [
            "--speculative-config",
            json.dumps(spec_json, sort_keys=True, separators=(",", ":")),
        ]
    if spec.lora is not None and role == naming.UNIFIED:
        args += spec.lora.runtime_args()
    args += ["--role", role]
    if role in (naming.PREFILL, naming.DECODE):
        # $(POD_IP) is expanded by the kubelet from the env of the same name (downward API).
        args += ["--kv-port", str(naming.KV_PORT), "--kv-host", "$(POD_IP)"]
        args += ["--kv-transport", kv_transport(spec) or "auto"]
    if spec.device == "cpu":
        args += ["--device", "cpu"]
    return args


def model_argument(model: ModelSource) -> str:
    """--model: the weights' path where a volume holds them (the image or claim is mounted
    at naming.MODEL_MOUNT), the built-in name, or the fields from before the sources."""
    inner: str | None
    if model.image is not None:
        inner = model.image.path
    elif model.claim is not None:
        inner = model.claim.path
    else:
        return model.builtin or model.path or model.name or ""
    return f"{naming.MODEL_MOUNT}/{inner}" if inner else naming.MODEL_MOUNT


def image_identity(reference: str) -> str:
    """What names an image's content: its digest where the reference pins one (a tag can
    move, and a digest outlives a renamed repository), else the reference itself."""
    _, at, digest = reference.rpartition("@")
    return digest if at else reference


def model_identity(model: ModelSource) -> dict[str, Any]:
    """The weights' identity in the compile-cache key. The fields from before the sources keep
    their keys as they were; the served name of a source never enters (it compiles nothing)."""
    legacy = {"name": model.name, "path": model.path, "loadFormat": model.load_format}
    if model.image is not None:
        source: dict[str, Any] = {
            "image": image_identity(model.image.reference),
            "path": model.image.path,
        }
    elif model.claim is not None:
        source = {"claim": model.claim.name, "path": model.claim.path}
    elif model.builtin is not None:
        source = {"builtin": model.builtin}
    else:
        return legacy
    return {"source": source, "loadFormat": model.load_format}


def speculative_json(spec: AtomDeploymentSpec, role: str) -> dict[str, Any] | None:
    """The role's --speculative-config; a prefill role never decodes and gets none."""
    if spec.speculative is None or role == naming.PREFILL:
        return None
    return spec.speculative.runtime_json()


def command_line(args: list[str]) -> str:
    return shlex.join(["atom-runtime", *args])


def cache_key(spec: AtomDeploymentSpec, role: str, image: str) -> str:
    """Hash of what changes compiled code: image, model identity, dtype, engine shape and the
    role's effective compilation and tensor-parallel size. Replicas, names, IPs and ports never
    enter it, nor prefixCaching, the router's routingPolicy or the KV transport (they change no
    compiled code or graph)."""
    comp = effective_compilation(spec, role)
    comp_fields = comp.model_dump(exclude_none=True)
    if graph_mode(spec, comp) == "NONE":  # ignored sizes must not split the cache
        comp_fields.pop("cudagraph_capture_sizes", None)
        comp_fields.pop("cuda_graph_sizes", None)
    identity: dict[str, Any] = {
        "image": image,
        "model": model_identity(spec.model),
        "dtype": spec.model.dtype,
        "engine": spec.engine.model_dump(),
        "compilation": comp_fields,
    }
    if spec.device != "gpu":  # only when set: the keys of existing GPU deployments stay as they are
        identity["device"] = spec.device
    if spec.quantization != "none":  # likewise: FP8 weights and caches are other compiled code
        identity["quantization"] = spec.quantization
    if spec.kv_cache_dtype != "auto":
        identity["kvCacheDtype"] = spec.kv_cache_dtype
    tensor = tensor_size(spec, role)
    if tensor != 1:  # likewise: TP 1 keys are the keys from before the field
        # Each rank's graph holds 1/N of the weights: pods of one size share a cache, others never.
        identity["tensorParallelSize"] = tensor
    spec_json = speculative_json(spec, role)
    if spec_json is not None:
        # Verify buckets of k + 1 rows and a draft model's graphs are different captured work.
        identity["speculative"] = spec_json
    return naming.digest(identity, 16)


def startup_budget_seconds(spec: AtomDeploymentSpec, role: str) -> int:
    """Time allowed before /health must pass: load + compile (by level) + capture (by sizes)."""
    comp = effective_compilation(spec, role)
    compile_s = {0: 0, 1: 60, 2: 300, 3: 600}[comp.level]
    capture_s = 5 * len(capture_sizes(spec, comp))
    return min(180 + compile_s + capture_s, 4 * 3600)
