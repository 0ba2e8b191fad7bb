"""The rules policy's options: exclude/include by node-name pattern or op, value limits, custom rules, patterns,
checked once (one clear error per bad option) into a ``RuleOptions`` record.

Input: the keywords a user gives (``RulesPolicy(...)`` or ``convert(policy="rules", ...)``). Output: ``RuleOptions``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.errors import PrecastError, module_path
from precast.policy.rules import patterns as sensitive


def compile_patterns(patterns: Iterable[str], option: str) -> list[re.Pattern]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    out = []
    for p in patterns:
        if not isinstance(p, str):
            raise PrecastError(
                f"{option}: {p!r} is not a string; give regular expressions like 'encoder\\.layer\\.0'"
            )
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise PrecastError(f"{option}: {p!r} is not a valid regular expression ({exc})") from exc
    return out


def resolve_op(spec: Any, option: str) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket:
    """An OpOverload / OpOverloadPacket, or a name: 'softmax', 'aten.softmax', 'aten::softmax', 'aten.softmax.int',
    'torch.ops.aten.softmax'. A name without an overload matches every overload."""
    if isinstance(spec, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PrecastError(
            f"{option}: {spec!r} is not an op; give torch.ops.aten.softmax (or .int) or a name like 'aten.softmax'"
        )
    text = spec.strip().removeprefix("torch.ops.").replace("::", ".")
    parts = text.split(".")
    ns, rest = (
        (parts[0], parts[1:])
        if len(parts) > 1
        and hasattr(torch.ops, parts[0])
        and parts[0] in ("aten", "prims", "quantized", "higher_order")
        or len(parts) > 2
        else ("aten", parts)
    )
    if len(rest) not in (1, 2) or not rest[0]:
        raise PrecastError(
            f"{option}: cannot read {spec!r} as an op name; write 'aten.softmax' or 'aten.softmax.int'"
        )
    try:
        packet = getattr(getattr(torch.ops, ns), rest[0])
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise AttributeError(rest[0])
        return getattr(packet, rest[1]) if len(rest) == 2 else packet
    except (AttributeError, RuntimeError) as exc:
        hint = f" (did you mean '{rest[0].lower()}'?)" if rest[0] != rest[0].lower() else ""
        raise PrecastError(f"{option}: no op named {spec!r} in torch.ops.{ns}{hint}") from exc


def matches_op(target: object, ops: list) -> object | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for op in ops:
        if target is op or (isinstance(op, torch._ops.OpOverloadPacket) and target.overloadpacket is op):
            return op
    return None


def match_node(node: torch.fx.Node, patterns: list[re.Pattern]) -> str | None:
    """What matched: ``re.search`` of each pattern on the node name, then on its module path."""
    path = module_path(node)
    for p in patterns:
        if p.search(node.name):
            return f"{p.pattern!r} matches its name"
        if path and p.search(path):
            return f"{p.pattern!r} matches its module {path}"
    return None


@dataclass
class RuleOptions:
    low: torch.dtype
    exclude_nodes: list[re.Pattern] = field(default_factory=list)
    exclude_ops: list = field(default_factory=list)
    include_nodes: list[re.Pattern] = field(default_factory=list)
    include_ops: list = field(default_factory=list)
    data_max: float | None = None
    init_max: float | None = None
    data_min: float | None = None  # flush_to_zero: values whose absmax stays below this underflow in `low`
    max_reduction_depth: int | None = None
    custom_rules: tuple = ()
    # precision-sensitive patterns kept in fp32 (precast.policy.rules.patterns.PATTERNS); all by default
    patterns: frozenset = frozenset(sensitive.PATTERNS)

    @classmethod
    def build(
        cls,
        low,
        exclude_nodes=(),
        exclude_ops=(),
        include_nodes=(),
        include_ops=(),
        data_max=None,
        init_max=None,
        max_reduction_depth=None,
        custom_rules=(),
        data_min=None,
        patterns=None,
    ) -> RuleOptions:
        """Checked options; ``patterns``: None (every precision-sensitive pattern), () (none), or names from
        ``precast.policy.rules.patterns.PATTERNS``."""
        if data_max is None and low == torch.float16:
            data_max = FP16_DATA_MAX
        if init_max is None:
            init_max = torch.finfo(low).max
        if data_min is None and low == torch.float16:
            # bf16 shares fp32's exponent range: what it flushes is already subnormal in fp32
            data_min = torch.finfo(low).tiny
        for name, value in (("data_max", data_max), ("init_max", init_max)):
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            ):
                raise PrecastError(f"{name}={value!r}: give a positive number (math.inf turns the rule off)")
        if data_min is not None and (not isinstance(data_min, (int, float)) or not 0 <= data_min < math.inf):
            raise PrecastError(f"data_min={data_min!r}: give a finite number >= 0 (0 turns the rule off)")
        if max_reduction_depth is not None and (
            not isinstance(max_reduction_depth, int)
            or isinstance(max_reduction_depth, bool)
            or max_reduction_depth < 1
        ):
            raise PrecastError(f"max_reduction_depth={max_reduction_depth!r}: give a positive integer")
        for rule in custom_rules:
            if not callable(rule):
                raise PrecastError(
                    f"custom_rules: {rule!r} is not callable; give functions (node, context) -> reason"
                )
        try:
            chosen = sensitive.parse_patterns(patterns)
        except ValueError as exc:
            raise PrecastError(str(exc)) from None
        ops = lambda xs, opt: [resolve_op(x, opt) for x in ((xs,) if isinstance(xs, str) else xs)]  # noqa: E731
        return cls(
            low=low,
            exclude_nodes=compile_patterns(exclude_nodes, "exclude_nodes"),
            exclude_ops=ops(exclude_ops, "exclude_ops"),
            include_nodes=compile_patterns(include_nodes, "include_nodes"),
            include_ops=ops(include_ops, "include_ops"),
            data_max=None if data_max is None or math.isinf(data_max) else float(data_max),
            init_max=None if math.isinf(init_max) else float(init_max),
            data_min=float(data_min) if data_min else None,
            max_reduction_depth=max_reduction_depth,
            custom_rules=tuple(custom_rules),
            patterns=chosen,
        )


FP16_DATA_MAX = 512.0
