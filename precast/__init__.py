"""precast: ahead-of-time mixed precision for torch.export programs.

res = precast.convert(program_or_module, example_inputs, policy=None | "torch" | "rules" | "auto" | a policy object, dtype=...)
res.program   # a standard torch.export.ExportedProgram: casts explicit, weights cast once
res.report    # every decision explained

Input/output: see ``convert``, ``report``, ``compile``; this module only re-exports the public API.
"""

from precast.api import ConvertResult, convert
from precast.errors import PrecastError
from precast.explain import Sensitivity, sensitivity
from precast.guard import guard_module
from precast.ir.program import constant_sources
from precast.policy.auto import AutoPolicy
from precast.policy.plan import Plan, load_plan
from precast.policy.rules.policy import RulesPolicy
from precast.policy.torch_policy import TorchPolicy
from precast.report.build import report
from precast.report.model import Report

__all__ = [
    "AutoPolicy",
    "ConvertResult",
    "Plan",
    "Sensitivity",
    "PrecastError",
    "Report",
    "RulesPolicy",
    "TorchPolicy",
    "constant_sources",
    "guard_module",
    "convert",
    "load_plan",
    "report",
    "sensitivity",
    "compile",
    "CompiledModel",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # compile pulls in torch._inductor: import it only when asked for (the module is precast.backends.aoti, so the
    # function precast.compile is never shadowed by a submodule of the same name)
    if name == "compile":  # backend="aoti" (default) or "openvino": precast.backends.compile dispatches
        from precast.backends import compile

        return compile
    if name == "CompiledModel":
        from precast.backends import aoti

        return aoti.CompiledModel
    raise AttributeError(f"module 'precast' has no attribute {name!r}")
