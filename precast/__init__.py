"""precast: ahead-of-time mixed precision for torch.export programs.

res = precast.convert(program_or_module, example_inputs, policy=None | "torch" | "rules" | "auto" | a policy object, dtype=...)
res.program   # a standard torch.export.ExportedProgram: casts explicit, weights cast once
res.report    # every decision explained

Input/output: see ``convert``, ``report``, ``compile``; this module only re-exports the public API.
"""

import warnings

from precast.interrupts import guard_startup

guard_startup()  # Ctrl-C while the `precast` command imports torch: one line, status 130 (precast/interrupts.py)

# torch warns on import when numpy is absent ("Failed to initialize NumPy"): precast needs no numpy (a bare `pip
# install precast` has none, torch does not bring it), so that line would open every command's output for nothing
warnings.filterwarnings(
    "ignore", message="Failed to initialize NumPy", category=UserWarning, module=r"torch\."
)

from precast.api import (  # noqa: E402
    CacheOptions,
    ConvertResult,
    IOOptions,
    VerifyOptions,
    WeightOptions,
    calibrate,
    convert,
)
from precast.errors import PrecastError  # noqa: E402
from precast.explain import Sensitivity, sensitivity  # noqa: E402
from precast.guard import guard_module  # noqa: E402
from precast.ir.program import constant_sources  # noqa: E402
from precast.llm import GenerationResult, LogitsOnly, generate  # noqa: E402
from precast.llm.exporter import ExportedFolder  # noqa: E402
from precast.llm.exporter import export as export_llm  # noqa: E402
from precast.llm.loaded import LLM, load  # noqa: E402
from precast.numerics.calibration.files import load_calibration  # noqa: E402
from precast.numerics.energies import Energies, load_energies  # noqa: E402
from precast.policy.auto import AutoPolicy  # noqa: E402
from precast.policy.measurements import Calibration  # noqa: E402
from precast.policy.plan import Plan, load_plan  # noqa: E402
from precast.policy.rules.policy import RulesPolicy  # noqa: E402
from precast.policy.torch_policy import TorchPolicy  # noqa: E402
from precast.quant.budget import Budget, WeightBudget  # noqa: E402
from precast.quant.formats import Float, Int4, Int8, Int8Asym, WeightFormat  # noqa: E402
from precast.quant.sensitivity import WeightSensitivity, weight_sensitivity  # noqa: E402
from precast.report.build import report  # noqa: E402
from precast.report.model import Report  # noqa: E402
from precast.weights.filled import with_weights  # noqa: E402
from precast.weights.weightless import empty_parameters, export_weightless  # noqa: E402

__all__ = [
    "AutoPolicy",
    "CacheOptions",
    "IOOptions",
    "VerifyOptions",
    "WeightOptions",
    "Calibration",
    "ConvertResult",
    "Energies",
    "Plan",
    "Sensitivity",
    "PrecastError",
    "Report",
    "RulesPolicy",
    "TorchPolicy",
    "constant_sources",
    "Budget",
    "WeightBudget",
    "WeightSensitivity",
    "weight_sensitivity",
    "WeightFormat",
    "Float",
    "Int8",
    "Int8Asym",
    "Int4",
    "guard_module",
    "calibrate",
    "convert",
    "load_calibration",
    "load_energies",
    "load_plan",
    "report",
    "sensitivity",
    "empty_parameters",
    "export_weightless",
    "with_weights",
    "compile",
    "CompiledModel",
    "generate",
    "GenerationResult",
    "LLM",
    "load",
    "export_llm",
    "ExportedFolder",
    "save",
    "LogitsOnly",
]
from precast.version import __version__ as __version__  # noqa: E402 - one home for the version


def __getattr__(name: str):
    # compile pulls in torch._inductor: import it only when asked for
    # backend= one of backends/registry.py's engines: precast.backends.compile dispatches
    if name == "compile":
        from precast.backends import compile

        return compile
    if name == "save":  # a compiled model's artifact and its record: precast.backends.registry
        from precast.backends.registry import save

        return save
    if name == "CompiledModel":
        from precast.backends.aoti.model import CompiledModel

        return CompiledModel
    raise AttributeError(f"module 'precast' has no attribute {name!r}")
