"""@support_torch_compile: compile a model class per the configured level.

Levels 0 and 1 leave the decorated class uncompiled (level 1 is applied by the runner with
compile_for_level: Dynamo with the eager backend). From level 2 the first call marks the
batch dimension of every tensor argument dynamic and compiles through VllmBackend; a
bytecode hook keeps Dynamo's transformed code, and later calls run that code directly:
no guard evaluation and no recompilation when the batch size changes.
"""

from __future__ import annotations

import dis
import inspect
import io
import logging
import os
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from torch._dynamo.types import BytecodeHook

from atom.compilation import warm_start
from atom.compilation.backends import (
    BufferMutationError,
    VllmBackend,
    cache_disabled,
    debug_dump_dir,
    get_rank,
)
from atom.config import CompilationLevel, Config
from atom.utils.counters import counters

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=torch.nn.Module)

_compile_start: float | None = None


def start_monitoring_torch_compile(atom_config: Config) -> None:
    """Note when compilation starts; end_monitoring_torch_compile logs how long it took."""
    global _compile_start
    _compile_start = time.perf_counter()
    dump = debug_dump_dir(atom_config.compilation_config)
    if dump:
        logger.info("compilation debug dump: %s", dump)


def end_monitoring_torch_compile(atom_config: Config) -> float:
    global _compile_start
    if _compile_start is None:
        return 0.0
    elapsed = time.perf_counter() - _compile_start
    _compile_start = None
    logger.info(
        "torch.compile (level %d) took %.2fs; cache: %s",
        atom_config.compilation_config.level,
        elapsed,
        atom_config.compilation_config.local_cache_dir or "-",
    )
    return elapsed


def _bytecode_hook(ref: weakref.ReferenceType) -> BytecodeHook:
    # A weak reference: Dynamo keeps hooks forever, the model must still be collectable.
    def hook(code: types.CodeType, new_code: types.CodeType) -> None:
        wrapper = ref()
        if wrapper is None or not wrapper._compiling or code is not wrapper.original_code_object:
            return None
        wrapper.compiled_codes.append(new_code)
        return None

    return hook


class TorchCompileWrapperWithCustomDispatcher:
    """Compiles `forward` once and afterwards dispatches to the compiled bytecode."""

    def __init__(self, atom_config: Config, compiled_callable: Callable | None = None) -> None:
        self.atom_config = atom_config
        level = atom_config.compilation_config.level
        self.backend: VllmBackend | None = None
        if compiled_callable is None:
            # Mixed into the model's nn.Module class (support_torch_compile).
            module = cast(torch.nn.Module, self)
            self.backend = VllmBackend(atom_config, prefix=type(self).__name__, module=module)
            compiled_callable = torch.compile(self.forward, fullgraph=True, backend=self.backend)
        self.compiled_callable = compiled_callable
        self.original_code_object: types.CodeType = type(self).forward.__code__
        self.compiled_codes: list[types.CodeType] = []
        self._compiling = False
        self._compile_attempted = False
        self._dispatch_fn: Callable | None = None
        self._warm_forward: Callable | None = None  # a saved trace in use (no Dynamo code)
        self._hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(
            _bytecode_hook(weakref.ref(self))
        )
        self.use_custom_dispatcher: bool = level >= CompilationLevel.DYNAMO_ONCE

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the decorated class overrides it
        raise NotImplementedError

    @contextmanager
    def dispatch_to_code(self, index: int) -> Iterator[None]:
        """The guide's API: run `forward` as compiled code `index` inside the block."""
        func = type(self).forward
        func.__code__ = self.compiled_codes[index]
        try:
            yield
        finally:
            func.__code__ = self.original_code_object

    def _compiled_forward(self) -> Callable:
        """A function object running compiled code 0 with forward's globals and closure.

        Calling it leaves the class untouched (thread-safe, unlike swapping __code__).
        """
        if self._dispatch_fn is None:
            func = type(self).forward
            self._dispatch_fn = types.FunctionType(
                self.compiled_codes[0], func.__globals__, func.__name__, func.__defaults__, func.__closure__
            )
            self._dispatch_fn.__kwdefaults__ = func.__kwdefaults__
        return self._dispatch_fn

    def _check_compiled_code(self) -> None:
        code = self.compiled_codes[0]
        text = _disassemble(code)
        for directory in (self.atom_config.compilation_config.local_cache_dir, debug_dump_dir(self.atom_config.compilation_config)):
            if directory and os.path.isdir(directory):
                path = os.path.join(directory, "transformed_code.txt")
                if not os.path.exists(path):
                    with open(path, "w") as f:
                        f.write(text)
        if "update" in code.co_names:
            self.compiled_codes.clear()
            raise BufferMutationError(
                "the compiled forward assigns nn.Module buffers or attributes (Dynamo emitted an "
                "`update` of module state); this is not allowed when compiling, because replays "
                "would silently use stale state. Use compilation level 0 or move the state out "
                "of the module. Transformed bytecode:\n" + text
            )


def _disassemble(code: types.CodeType) -> str:
    out = io.StringIO()
    dis.dis(code, file=out)
    return out.getvalue()


def _bind_tensor_args(module: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    bound = warm_start.bind_arguments(module, args, kwargs)
    return [v for v in bound.values() if isinstance(v, torch.Tensor) and v.ndim > 0]


def _wrapped_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    if self.do_not_compile or torch.compiler.is_compiling():
        return self.forward(*args, **kwargs)
    if self._warm_forward is not None:
        return self._warm_forward(self, args, kwargs)
    if self.compiled_codes and self.use_custom_dispatcher:
        return self._compiled_forward()(self, *args, **kwargs)
    if self._compile_attempted:
        # No transformed code was captured (should not happen): keep Dynamo's own dispatch.
        return self.compiled_callable(*args, **kwargs)
    tensors = _bind_tensor_args(self, args, kwargs)
    if any(t.shape[0] < 2 for t in tensors):
        # Dynamo specialises a dimension of size 0 or 1: compile on a batch >= 2.
        logger.debug("batch < 2: running eagerly until a batch >= 2 can be compiled")
        return self.forward(*args, **kwargs)
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)
    start_monitoring_torch_compile(self.atom_config)
    trace_path = _trace_entry_path(self, args, kwargs)
    if trace_path is not None:
        forward = _forward_from_saved_trace(self, trace_path)
        if forward is not None:
            self._warm_forward = forward
            self._compile_attempted = True
            end_monitoring_torch_compile(self.atom_config)
            return forward(self, args, kwargs)
    torch._dynamo.eval_frame.remove_from_cache(self.original_code_object)
    self._compile_attempted = True
    self._compiling = True
    try:
        output = self.compiled_callable(*args, **kwargs)
    except Exception as exc:
        inner = getattr(exc, "inner_exception", None)
        if isinstance(inner, BufferMutationError):
            raise inner from None
        raise
    finally:
        self._compiling = False
    if self.compiled_codes and self.use_custom_dispatcher:
        self._check_compiled_code()
        end_monitoring_torch_compile(self.atom_config)
        if trace_path is not None:
            _save_trace(self, trace_path, args, kwargs, output)
    elif not self.compiled_codes:
        logger.warning("Dynamo produced no code for %s: guards stay on", type(self).__name__)
    return output


def _trace_entry_path(self: Any, args: tuple, kwargs: dict) -> str | None:
    """Where this forward's Dynamo trace is saved (None: the artifact cache is off)."""
    backend = self.backend
    if backend is None or not self.use_custom_dispatcher or cache_disabled():
        return None
    key = warm_start.pretrace_key(self, backend.prefix, args, kwargs)
    return warm_start.entry_path(backend.cache_root(), key, get_rank(), backend.prefix)


def _forward_from_saved_trace(self: Any, path: str) -> Callable | None:
    entry = warm_start.load(path)
    if entry is None:
        return None
    try:
        compiled = self.backend.from_trace(warm_start.graph_of(entry), entry.hash_key,
                                           entry.dynamic_inputs, entry.piece_sym_indices)
    except Exception as exc:  # noqa: BLE001 - any failure: trace with Dynamo instead
        logger.warning("saved Dynamo trace %s not used (%s); tracing again", path, exc)
        return None
    counters.inc("dynamo_traces_loaded")
    logger.info("loaded the Dynamo trace of %s from %s (no tracing)", type(self).__name__, path)
    return warm_start.make_forward(entry, compiled)


def _save_trace(self: Any, path: str, args: tuple, kwargs: dict, output: Any) -> None:
    try:
        entry = warm_start.build_entry(self.backend, self, args, kwargs, output)
        if entry is not None:
            warm_start.save(path, entry)
    except Exception as exc:  # noqa: BLE001 - the trace is an optimisation: never fatal
        logger.warning("could not save the Dynamo trace to %s: %s", path, exc)


def support_torch_compile(cls: type[_M] | None = None) -> Any:
    """Class decorator; the class's __init__ takes the Config as keyword `atom_config`."""

    def decorate(cls: type[_M]) -> type[_M]:
        if TorchCompileWrapperWithCustomDispatcher not in cls.__mro__:
            cls.__bases__ = (*cls.__bases__, TorchCompileWrapperWithCustomDispatcher)
        old_init = cls.__init__

        def __init__(self: Any, *args: Any, atom_config: Config, **kwargs: Any) -> None:
            old_init(self, *args, atom_config=atom_config, **kwargs)
            self.atom_config = atom_config
            # enforce_eager is decided in Config: it sets level 0.
            level = atom_config.compilation_config.level
            self.do_not_compile = level in (
                CompilationLevel.NO_COMPILATION,
                CompilationLevel.DYNAMO_AS_IS,
            )
            if self.do_not_compile:
                return
            TorchCompileWrapperWithCustomDispatcher.__init__(self, atom_config=atom_config)

        __init__.__signature__ = inspect.signature(old_init)  # type: ignore[attr-defined]
        # Patching the class in place is this decorator's job.
        cls.__init__ = __init__  # type: ignore[method-assign]  # patch
        cls.__call__ = _wrapped_call  # type: ignore[method-assign]  # patch
        return cls

    if cls is None:
        return decorate
    return decorate(cls)


def compile_for_level(model: _M, atom_config: Config) -> _M:
    """The runner's part: level 1 runs the whole model through Dynamo with the eager backend
    (fullgraph, so a graph break is an error: level 1 is a compatibility check). Other levels
    return the model unchanged (levels >= 2 compile inside @support_torch_compile)."""
    if atom_config.compilation_config.level != CompilationLevel.DYNAMO_AS_IS:  # 0 under enforce_eager
        return model
    # An instance attribute shadows the class's forward for nn.Module.__call__ and for the
    # decorator's __call__ alike.
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    return model
