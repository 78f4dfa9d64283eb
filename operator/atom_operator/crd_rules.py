"""The CRD's cross-field rules as CEL strings (`x-kubernetes-validations`).

Pure string builders: the API server evaluates what they return, so a bad manifest is refused
at admission. `spec.AtomDeploymentSpec` and `crdgen` attach them; the constants below are the
limits they encode, shared with the spec models and the builders.
"""

from __future__ import annotations

TENSOR_SIZES = (1, 2, 4, 8)  # powers of two up to one node's GPUs
GPU_RESOURCE = "nvidia.com/gpu"
# Transports that need the prefill and decode pod of a pair on one node's GPUs.
CO_LOCATED_TRANSPORTS = ("cuda-ipc", "nccl")
MAX_CAPTURE_SIZES = 512  # bounds the CEL cost estimate of the per-size rules
DEFAULT_MAX_NUM_SEQS = 512  # the runtime's default (atom.cli.args)
# metadata.name is the endpoint Service's name and the app.kubernetes.io/instance label value
# of every child: both are DNS-1035 labels (63 characters, lowercase, no dots).
MAX_NAME_LENGTH = 63
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The paths whose lists are capture sizes, checked against engine.maxNumSeqs.
COMPILATION_PATHS = (
    "compilation",
    "disaggregation.prefill.compilation",
    "disaggregation.decode.compilation",
)

# CEL cannot read fields an object only preserves (x-kubernetes-preserve-unknown-fields), so
# the GPU count of a resources object is declared; every other key stays free-form.
_GPU_CEL = "nvidia__dot__com__slash__gpu"  # CEL's escaping of the property nvidia.com/gpu


def _has_chain(path: str, known: str = "") -> str:
    """CEL: every step of the dotted `path` under self is set (the `known` prefix is)."""
    parts = path.split(".")
    skip = len(known.split(".")) if known else 0
    steps = [f"has(self.{'.'.join(parts[: i + 1])})" for i in range(skip, len(parts))]
    return " && ".join(steps)


def _gpu_matches(resources: str, tensor: str, known: str = "") -> str:
    """CEL: the nvidia.com/gpu limit and request of `resources`, where set, equal `tensor`
    (a quantity is an int or a string: compared as text, 2 == "2")."""
    checks = []
    for kind in ("limits", "requests"):
        amount = f"{resources}.{kind}.{_GPU_CEL}"
        checks.append(
            f"(!({_has_chain(amount, known)}) || string(self.{amount}) == string({tensor}))"
        )
    return " && ".join(checks)


def tensor_gpu_rules() -> list[dict[str, str]]:
    """CEL: an explicit tensor size and an explicit nvidia.com/gpu count of the same pods agree.
    The operator renders the GPU count from the tensor size only where the spec names none;
    a count set beside an unset tensor size is left as it is (specs from before the field)."""
    shared_set = _has_chain("parallelism.tensor")
    on_gpu = "(!has(self.device) || self.device == 'gpu')"
    hint = "leave the GPU count unset and the operator renders it"
    rules = [
        {
            "rule": f"!({on_gpu} && !has(self.disaggregation) && {shared_set}) "
            f"|| ({_gpu_matches('resources', 'self.parallelism.tensor')})",
            "message": "resources.limits/requests nvidia.com/gpu must equal parallelism.tensor "
            f"({hint})",
            "fieldPath": ".parallelism.tensor",
            "reason": "FieldValueInvalid",
        }
    ]
    for role in ("prefill", "decode"):
        base = f"disaggregation.{role}"  # present whenever disaggregation is (required)
        own_set = _has_chain(f"{base}.parallelism.tensor", base)
        tensor = f"({own_set} ? self.{base}.parallelism.tensor : self.parallelism.tensor)"
        own = _gpu_matches(f"{base}.resources", tensor, f"{base}.resources")
        inherited = _gpu_matches("resources", tensor)
        rules.append(
            {
                "rule": f"!({on_gpu} && has(self.disaggregation) && ({own_set} || {shared_set})) "
                f"|| (has(self.{base}.resources) ? ({own}) : ({inherited}))",
                "message": f"nvidia.com/gpu limits/requests of {base}.resources (or of resources, "
                f"which the role inherits) must equal {base}.parallelism.tensor (or "
                f"parallelism.tensor, which the role inherits): {hint}",
                "fieldPath": f".{base}.parallelism",
                "reason": "FieldValueInvalid",
            }
        )
    return rules


def kv_transport_rule() -> dict[str, str]:
    """CEL: the GPU-to-GPU transports need GPUs."""
    listed = ", ".join(f"'{t}'" for t in CO_LOCATED_TRANSPORTS)
    return {
        "rule": "!(has(self.disaggregation) && has(self.disaggregation.kvTransport) "
        f"&& self.disaggregation.kvTransport in [{listed}]) "
        "|| !has(self.device) || self.device == 'gpu'",
        "message": "disaggregation.kvTransport cuda-ipc and nccl need device gpu: use auto or "
        "tcp with device cpu",
        "fieldPath": ".disaggregation.kvTransport",
        "reason": "FieldValueForbidden",
    }


def _sizes_rule(path: str, *, single_value_clamped: bool = False) -> dict[str, str]:
    """CEL: every capture size of `path` is at most engine.maxNumSeqs (defaults applied), as
    the runtime's Config checks it. One cudaGraphSizes value N is a pattern the runtime clamps
    to maxNumSeqs, so only lists of two or more values are checked there."""
    parts = path.split(".")
    guards = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    max_seqs = f"(has(self.engine) && has(self.engine.maxNumSeqs) ? self.engine.maxNumSeqs : {DEFAULT_MAX_NUM_SEQS})"
    check = f"self.{path}.all(s, s <= {max_seqs})"
    message = f"every size in {path} must be at most engine.maxNumSeqs"
    if single_value_clamped:
        check = f"size(self.{path}) <= 1 || {check}"
        message = (
            f"{path} with several values is used as is: every value must be at most "
            "engine.maxNumSeqs (one value N is a pattern clamped to maxNumSeqs)"
        )
    return {
        "rule": f"!({guards}) || {check}",
        "message": message,
        "fieldPath": f".{path}",
        "reason": "FieldValueInvalid",
    }


def size_rules() -> list[dict[str, str]]:
    """Every capture-size list of every compilation block, whatever its length."""
    rules = []
    for path in COMPILATION_PATHS:
        rules.append(_sizes_rule(f"{path}.cudagraphCaptureSizes"))
        rules.append(_sizes_rule(f"{path}.cudaGraphSizes", single_value_clamped=True))
    return rules


def _for_new_names(check: str) -> str:
    """CEL: `check` holds, or the object had this same name before (a transition rule, with
    optionalOldSelf): a name rule added in a later CRD refuses new objects, never the patches
    of one an earlier CRD accepted, which would strand it (issue 49)."""
    return (
        "(oldSelf.hasValue() && oldSelf.value().metadata.name == self.metadata.name) "
        f"|| {check}"
    )


def root_rules() -> list[dict[str, object]]:
    """CEL on the whole object (only there can a rule read metadata.name). No fieldPath: the
    schema may not describe metadata, so the message names the field itself."""
    why = (
        "it names the endpoint Service and is the app.kubernetes.io/instance label of every "
        "child, both DNS-1035 labels"
    )
    return [
        {
            "rule": _for_new_names(f"size(self.metadata.name) <= {MAX_NAME_LENGTH}"),
            "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters: {why}",
            "reason": "FieldValueInvalid",
            "optionalOldSelf": True,
        },
        {
            "rule": _for_new_names(f"self.metadata.name.matches('{NAME_PATTERN}')"),
            "message": "metadata.name must be lowercase letters, digits and '-', start with a "
            f"letter and end with a letter or digit (no dots): {why}",
            "reason": "FieldValueInvalid",
            "optionalOldSelf": True,
        },
    ]


def _cpu_graph_rule(path: str) -> dict[str, str]:
    """CEL: on device cpu a graph mode set in `path` must be NONE (CUDA graphs need a GPU)."""
    parts = f"{path}.cudagraphMode".split(".")
    guards = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    return {
        "rule": f"!(has(self.device) && self.device == 'cpu' && {guards}) "
        f"|| self.{path}.cudagraphMode == 'NONE'",
        "message": f"device cpu runs no CUDA graphs: {path}.cudagraphMode must be NONE or unset",
        "fieldPath": f".{path}.cudagraphMode",
        "reason": "FieldValueForbidden",
    }


def cpu_graph_rules() -> list[dict[str, str]]:
    """On device cpu, every compilation block's graph mode is NONE or unset."""
    return [_cpu_graph_rule(path) for path in COMPILATION_PATHS]


def autoscaling_rules() -> list[dict[str, str]]:
    """Autoscaling of the unified role and of disaggregated roles are separate fields."""
    return [
        {
            "rule": "!has(self.autoscaling) || !has(self.disaggregation)",
            "message": "spec.autoscaling scales the unified role: with disaggregation set "
            "disaggregation.prefill.autoscaling and disaggregation.decode.autoscaling instead",
            "fieldPath": ".autoscaling",
            "reason": "FieldValueForbidden",
        },
        {
            # The API server's scale subresource fails while its specReplicasPath is unset, and
            # KEDA then creates no HPA.
            "rule": "!has(self.autoscaling) || has(self.replicas)",
            "message": "spec.autoscaling needs spec.replicas (the pods until the HPA acts): KEDA "
            "and the HPA scale through the scale subresource, which reads it",
            "fieldPath": ".replicas",
            "reason": "FieldValueRequired",
        },
    ]


def spec_rules() -> list[dict[str, str]]:
    """Every cross-field rule on the spec object, in the CRD's order."""
    return [
        {
            "rule": "!(has(self.replicas) && has(self.disaggregation))",
            "message": "replicas and disaggregation are mutually exclusive: set "
            "disaggregation.prefill.replicas and disaggregation.decode.replicas instead",
            "fieldPath": ".replicas",
            "reason": "FieldValueForbidden",
        },
        *size_rules(),
        *cpu_graph_rules(),
        *tensor_gpu_rules(),
        kv_transport_rule(),
        *autoscaling_rules(),
    ]


# spec.model: where the weights come from. At most one of these; the legacy model.path and
# model.volume (a container path and any volume source) only without one.
MODEL_SOURCES = ("image", "claim", "builtin")


def _any_source() -> str:
    return " || ".join(f"has(self.{s})" for s in MODEL_SOURCES)


def model_rules() -> list[dict[str, str]]:
    """CEL on spec.model. Every rule only reads fields added with the sources, or relaxes the
    rule before them, so objects stored under the previous CRD stay valid."""
    sources = "model.image, model.claim or model.builtin"
    rules: list[dict[str, str]] = [
        {
            "rule": f"has(self.name) || has(self.path) || {_any_source()}",
            "message": f"model needs a source of weights: {sources} (or model.name, a "
            "built-in shape, or model.path, a directory in the container)",
            "reason": "FieldValueRequired",
        }
    ]
    for i, first in enumerate(MODEL_SOURCES):
        for second in MODEL_SOURCES[i + 1 :]:
            rules.append(
                {
                    "rule": f"!(has(self.{first}) && has(self.{second}))",
                    "message": f"model.{second} is not allowed with model.{first}: set exactly "
                    "one source of weights",
                    "fieldPath": f".{second}",
                    "reason": "FieldValueForbidden",
                }
            )
    rules += [
        {
            "rule": f"!has(self.path) || !({_any_source()})",
            "message": f"model.path (a directory in the container) is not allowed with "
            f"{sources}: a file inside the image or claim is model.image.path or "
            "model.claim.path",
            "fieldPath": ".path",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": f"!has(self.volume) || !({_any_source()})",
            "message": f"model.volume is not allowed with {sources}: the operator renders "
            "their volume itself",
            "fieldPath": ".volume",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": f"!(has(self.loadFormat) && self.loadFormat == 'dummy') || !({_any_source()})",
            "message": f"model.loadFormat dummy (random weights) contradicts {sources}: use "
            "auto to load their weights",
            "fieldPath": ".loadFormat",
            "reason": "FieldValueForbidden",
        },
    ]
    return rules


def source_path_rule(source: str) -> dict[str, str]:
    """CEL: model.<source>.path is relative to the mounted image or claim and stays inside it."""
    return {
        "rule": "!has(self.path) || (!self.path.startsWith('/') && "
        "!self.path.matches('(^|/)[.][.](/|$)'))",
        "message": f"model.{source}.path is relative to the {source}'s root and stays inside "
        "it: no leading '/' and no '..'",
        "fieldPath": ".path",
        "reason": "FieldValueInvalid",
    }
