"""precast: ahead-of-time mixed precision for torch.export programs.

res = precast.convert(program_or_module, example_inputs, policy=None | "torch" | "rules", dtype=...)
res.program   # a standard torch.export.ExportedProgram: casts explicit, weights cast once
res.report    # every decision explained
"""

from precast.convert import ConvertResult, convert
from precast.diagnostics import guard_module
from precast.errors import PrecastError
from precast.program import constant_sources
from precast.report import Report, report

__all__ = [
    "ConvertResult",
    "PrecastError",
    "Report",
    "constant_sources",
    "guard_module",
    "convert",
    "report",
    "compile",
    "CompiledModel",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # compile pulls in torch._inductor: import it only when asked for (the module is precast.aoti, so the
    # function precast.compile is never shadowed by a submodule of the same name)
    if name in ("compile", "CompiledModel"):
        from precast import aoti

        return getattr(aoti, name)
    raise AttributeError(f"module 'precast' has no attribute {name!r}")
