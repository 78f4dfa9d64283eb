"""The guide's spelling of atom.utils.compiler_interface (kept importable on purpose)."""

from atom.utils.compiler_interface import (  # noqa: F401
    AlwaysHitShapeEnv,
    CompilerInterface,
    CorruptArtifactError,
    EagerAdaptor,
    InductorAdaptor,
    InductorStandaloneAdaptor,
    make_compiler,
)

__all__ = [
    "AlwaysHitShapeEnv",
    "CompilerInterface",
    "CorruptArtifactError",
    "EagerAdaptor",
    "InductorAdaptor",
    "InductorStandaloneAdaptor",
    "make_compiler",
]
