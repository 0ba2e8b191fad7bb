"""The optional hooks of a policy, with their defaults: how a policy of any class opts into calibration, the
tolerance search, the device fallback, a ``keep_io_types`` default and its verification reference.

A policy is any object with ``name``, ``autocast_state(device_type)`` and ``decide(node, args, kwargs)``
(``precast.policy.base.Policy``). Everything else is a hook the conversion reads with ``hook(policy, name)``:
the policy's own attribute when it has one (a subclass of a built-in policy keeps what it overrides), else
the default on ``PolicyHooks``. A policy may inherit ``PolicyHooks`` to see the defaults, or not.

Input: a policy object. Output: its hooks; ``Binding``, what a policy's decider is bound to a program with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from precast.ir.program import Program
from precast.policy.base import Decision, Policy

if TYPE_CHECKING:
    from precast.policy.measurements import Calibration, ToleranceResult


class PolicyHooks:
    """The hooks a policy may define, and their defaults (what a policy without them gets).

    - ``device_type`` / ``dtype``: the device type and low dtype the policy is for (None: the program's device,
      its autocast dtype); ``convert(dtype=..., device_type=...)`` must agree with them.
    - ``for_device(device_type, dtype)``: the policy once the program's device type and the low dtype are
      known (``TorchPolicy`` fills in its own); default: the policy itself.
    - ``capture_under_autocast``: on a module, trace its forward inside ``torch.autocast`` (policy torch).
    - ``keep_io_types``: the default of ``convert(io=IOOptions(keep_types=None))``.
    - ``reference``: what verification compares with: ``"autocast"`` (eager autocast; a difference is a
      ``not-bitwise`` warning) or ``"measured"`` (the unconverted program; the difference is information).
    - ``prepare_steps``: of ``"calibrate"``, ``"latency"``, ``"tolerance"`` (``precast.pipeline.prepare``),
      run for a policy that has ``bind``: ``calibrate`` measures ``calibration`` (data), ``latency`` times each
      matmul/conv/attention op unless ``latencies`` gives the table (cached in ``cache_dir``), ``tolerance``
      searches the ops to keep fp32 for ``tolerance`` (a dict of bounds).
    - ``options(low)``: the policy's checked options, handed to ``bind`` (default None).
    - ``tolerance_candidate(decision)``: whether the tolerance search may keep that (low) op fp32; default:
      the policy decided it (``decision.source == name``); rules: no rule but the default did.
    - ``bind(program, options, calibration, fallback=..., device_fp32=..., **extra)``: the decider for one
      program (no default: a policy without ``bind`` decides itself). ``fallback``: node -> score, the ops the
      tolerance search keeps fp32; ``device_fp32``: node -> what failed, the ops the device fallback keeps fp32.
    - ``after_lowering``: of ``"device_fallback"``, ``"auto_confirm"`` (``precast.pipeline.after_lowering``):
      checks run on the converted program, each of which may convert again through ``bind``.
    """

    device_type: ClassVar[str | None] = None
    dtype: ClassVar[torch.dtype | str | None] = None
    capture_under_autocast: ClassVar[bool] = False
    keep_io_types: ClassVar[bool] = False
    reference: ClassVar[str] = "measured"
    prepare_steps: ClassVar[tuple[str, ...]] = ("calibrate", "tolerance")
    after_lowering: ClassVar[tuple[str, ...]] = ()
    calibration: ClassVar[Iterable[Any] | None] = None
    tolerance: ClassVar[Mapping[str, float] | None] = None
    latencies: ClassVar[Mapping[str, Any] | None] = None
    cache_dir: ClassVar[str | None] = None

    def for_device(self, device_type: str, dtype: torch.dtype | None) -> Policy:
        return self  # type: ignore[return-value]

    def options(self, low: torch.dtype) -> object:
        return None

    def tolerance_candidate(self, decision: Decision) -> bool:
        """Whether the tolerance search may keep this low op fp32: by default, the policy's own decisions."""
        return decision.source == self.name  # type: ignore[attr-defined]


def hook(policy: Policy, name: str) -> Any:
    """The policy's hook ``name``, or ``PolicyHooks``' default bound to the policy."""
    if hasattr(policy, name):
        return getattr(policy, name)
    default = getattr(PolicyHooks, name)
    return default.__get__(policy) if callable(default) else default


def binds(policy: Policy | None) -> bool:
    """Whether the policy binds a decider per program (``bind``), so preparation and re-lowering apply."""
    return policy is not None and callable(getattr(policy, "bind", None))


@dataclass
class Binding:
    """Everything a policy's decider for one program was bound with, so a re-lowering (the device fallback,
    auto's confirmation) binds a decider for a fresh copy of the program the same way."""

    options: object = None
    calibration: Calibration | None = None
    search: ToleranceResult | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. auto's latency table
    latency_run: Any = None  # precast.numerics.latency.LatencyRun when the latency step measured

    @property
    def tolerance_fp32(self) -> dict[str, float] | None:
        """node -> score: the ops the tolerance search keeps in fp32 (None without a search)."""
        return self.search.kept if self.search is not None else None

    def bind(self, policy: Policy, program: Program, **more: Any) -> Policy:
        """``policy.bind`` for ``program`` with everything bound so far (``more``: e.g. ``device_fp32=``)."""
        return policy.bind(  # type: ignore[attr-defined]
            program, self.options, self.calibration, fallback=self.tolerance_fp32, **self.extra, **more
        )
