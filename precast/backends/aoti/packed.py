"""Weights the compiled code reads through packed copies (Inductor's C++ GEMM template on CPU, ``max-autotune``):
record the copies a compile adds, find the stored weight and the packing that reproduces each bit for bit, and
pack new weights the same way, so ``CompiledModel.load_weights`` keeps them swappable (``precast/backends/aoti/compiler.py``).

Input: the constants a compile added, the program's weights. Output: per packed constant, its plan
(``{"source", "transposed", "block_n", "vnni"}``); ``gemm_pack`` applies one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


@contextlib.contextmanager
def _observed_constants(observe: Callable[[torch.Tensor, str | None, Any], None]) -> Iterator[None]:
    """Inductor's ``GraphLowering.add_tensor_constant`` wrapped for the block: ``observe(data, name, box)`` sees
    each constant the lowering adds (the process-wide hook restored in ``finally``; call under ``TORCH_LOCK``)."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.add_tensor_constant

    def add_tensor_constant(self: Any, data: torch.Tensor, name: str | None = None) -> Any:
        box = original(self, data, name)
        observe(data, name, box)
        return box

    GraphLowering.add_tensor_constant = add_tensor_constant  # type: ignore[method-assign]
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = original  # type: ignore[method-assign]


@contextlib.contextmanager
def record_new_constants() -> Iterator[dict[str, torch.Tensor]]:
    """Record the 3-d constants Inductor adds while lowering, by the name the package gives them.

    The C++ GEMM template (CPU, ``max_autotune``) adds one per weight it uses: the weight blocked into
    ``[n / block_n, k, block_n]`` (VNNI-interleaved for 16-bit types), computed from the weight's value at
    compile time; its code reads only that copy. Call under ``TORCH_LOCK`` (the hook is process-wide)."""
    added: dict[str, torch.Tensor] = {}

    def observe(data: torch.Tensor, name: str | None, box: Any) -> None:
        # no failure is swallowed here (no silent except in the core): these reads cannot fail on a tensor, and a
        # copy not recorded is named by load_weights' refusal
        real = type(data) is torch.Tensor or type(data) is torch.nn.Parameter
        # name None: made by the lowering (the template's copies); the program's own constants come with their
        # names (a 3-d KV cache, int_weights's [K/g, N, 2] int4 scales). Integer copies too (the template on an int8
        # weight): matched like the others, or unmatched and refused by load_weights, never served stale
        if name is None and real and data.dim() == 3 and not data.is_mkldnn and not data.is_complex():
            added[box.get_name()] = data

    with _observed_constants(observe):
        yield added


@contextlib.contextmanager
def record_scalar_constants() -> Iterator[dict[str, tuple[Any, torch.Tensor]]]:
    """Record the 0-d constants Inductor adds while lowering (the int4 kernel's group size, ``constantN``) as
    ``{name: (recipe, value)}``, each recipe a literal (``aten::scalar_tensor``) that ``replay`` rebuilds: with
    the constants outside the package the loader must be handed them. Call under ``TORCH_LOCK``."""
    added: dict[str, tuple[Any, torch.Tensor]] = {}

    def observe(data: torch.Tensor, name: str | None, box: Any) -> None:
        # name None: made by a lowering, not one of the program's constants (those come with their names)
        real = type(data) is torch.Tensor and not data.is_mkldnn and data.device.type != "meta"
        if name is None and real and data.dim() == 0 and not data.is_complex():
            kwargs = {
                "dtype": {"dtype": str(data.dtype).removeprefix("torch.")},
                "device": {"device": str(data.device)},
            }
            recipe = {"op": "aten::scalar_tensor.default", "args": [data.item()], "kwargs": kwargs}
            added[box.get_name()] = (recipe, data)

    with _observed_constants(observe):
        yield added


def gemm_pack(weight: torch.Tensor, *, transposed: bool, block_n: int, vnni: int) -> torch.Tensor:
    """``weight`` laid out as Inductor's C++ GEMM template stores a constant B (``k x n``): padded to a multiple of
    ``block_n`` columns, blocked into ``[n / block_n, k, block_n]``, then with ``vnni`` > 1 consecutive rows of k
    interleaved (``CppGemmTemplate.block_weight`` / ``pack_vnni_weight``). ``transposed``: ``weight`` is a Linear's
    ``[n, k]`` (B is its transpose)."""
    b = weight.t() if transposed else weight
    k, n = b.shape
    blocks = -(-n // block_n)
    out = torch.nn.functional.pad(b, (0, blocks * block_n - n)).reshape(k, blocks, block_n).transpose(0, 1)
    if vnni > 1:
        out = out.reshape(blocks, k // vnni, vnni, block_n).transpose(-1, -2).reshape(blocks, k, block_n)
    return out.contiguous()


def match_packed(
    added: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """For each packed constant, the stored weight and the ``gemm_pack`` arguments that reproduce it bit for bit
    (``{name: {"source", "transposed", "block_n", "vnni"}}``), and the names of those no weight reproduces."""
    candidates = [(name, w) for name, w in sources.items() if w.dim() == 2]
    plans: dict[str, dict[str, Any]] = {}
    unmatched: list[str] = []
    for pname, packed in added.items():
        blocks, k, block_n = packed.shape
        found = None
        for sname, w in candidates:
            if w.dtype != packed.dtype:
                continue
            for transposed in (True, False):
                kk, n = (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])
                if kk != k or not (blocks - 1) * block_n < n <= blocks * block_n:
                    continue
                head = w[:block_n] if transposed else w[:, :block_n]  # the first block: a cheap test first
                for vnni in (1, 2, 4):
                    if k % vnni:
                        continue
                    kw = {"transposed": transposed, "block_n": block_n, "vnni": vnni}
                    if torch.equal(gemm_pack(head, **kw), packed[:1]) and torch.equal(
                        gemm_pack(w, **kw), packed
                    ):
                        found = {"source": sname, **kw}
                        break
                if found:
                    break
            if found:
                break
        if found:
            plans[pname] = found
        else:
            unmatched.append(pname)
    return plans, unmatched


# ---- constants folded at compile time (freezing): recorded as recipes, replayed at load ----------------------
@contextlib.contextmanager
def record_folded_constants() -> Iterator[dict[str, tuple[Any, torch.Tensor]]]:
    """Record each constant Inductor's constant folding creates (``freezing``: a weight's transpose, its oneDNN
    blocked copy from ``mkldnn._reorder_linear_weight``), as ``{name: (recipe, value)}``.

    The recipe is the folded subgraph as JSON-able data (``{"ref": name}`` for a constant it reads,
    ``{"op": "ns::name.overload", "args": [...], "kwargs": {...}}`` for a call), with the constants folded
    earlier inlined, so it reads only the program's constants; a subgraph holding a value JSON cannot state
    gets recipe None (that constant stays unmatched). ``replay`` recomputes a recipe from new weights. Call under
    ``TORCH_LOCK`` (the hook is process-wide)."""
    import torch._inductor.constant_folding as constant_folding

    folded: dict[str, tuple[Any, torch.Tensor]] = {}
    original = constant_folding.replace_node_with_constant

    def replace_node_with_constant(
        gm: torch.fx.GraphModule, node: torch.fx.Node, constant: Any = None, name: str | None = None
    ) -> None:
        recipe = _recipe(node, {k: r for k, (r, _) in folded.items()}) if constant is not None else None
        label = node.name
        original(gm, node, constant, name)
        if constant is None:
            return
        made = [n for n in gm.graph.nodes if n.op == "get_attr" and n.name == label]
        if len(made) == 1 and isinstance(constant, torch.Tensor):
            folded[str(made[0].target)] = (recipe, constant)

    constant_folding.replace_node_with_constant = replace_node_with_constant
    try:
        yield folded
    finally:
        constant_folding.replace_node_with_constant = original


class _Unstated(Exception):
    """A folded subgraph holds a value a recipe cannot state (caught in ``_recipe`` only: no recipe)."""


def _recipe(node: torch.fx.Node, earlier: Mapping[str, Any]) -> Any:
    try:
        return _expr(node, earlier)
    except _Unstated:
        return None


def _expr(value: Any, earlier: Mapping[str, Any]) -> Any:
    if isinstance(value, torch.fx.Node):
        if value.op in ("get_attr", "placeholder"):
            target = str(value.target)
            return earlier.get(target, {"ref": target})
        op = value.target
        if value.op == "call_function" and isinstance(op, torch._ops.OpOverloadPacket):
            op = op.default  # freezing's passes call some ops by packet (mkldnn._reorder_linear_weight)
        if value.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            raise _Unstated
        return {
            "op": f"{op.namespace}::{op._opname}.{op._overloadname}",
            "args": [_expr(a, earlier) for a in value.args],
            "kwargs": {k: _expr(v, earlier) for k, v in value.kwargs.items()},
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_expr(v, earlier) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise _Unstated


def recipe_sources(recipe: Any) -> set[str]:
    """The program constants a recipe reads."""
    if isinstance(recipe, dict):
        if "ref" in recipe:
            return {recipe["ref"]}
        if "op" in recipe:
            out: set[str] = set()
            for a in [*recipe["args"], *recipe["kwargs"].values()]:
                out |= recipe_sources(a)
            return out
        return set()
    if isinstance(recipe, list):
        return set().union(*(recipe_sources(r) for r in recipe)) if recipe else set()
    return set()


def replay(recipe: Any, values: Mapping[str, torch.Tensor]) -> Any:
    """The value a recipe computes from ``values`` (the program's constants by name), as the compile folded it."""
    if isinstance(recipe, list):
        return [replay(r, values) for r in recipe]
    if not isinstance(recipe, dict):
        return recipe
    if "ref" in recipe:
        return values[recipe["ref"]]
    if "op" in recipe:
        qualified, overload = recipe["op"].rsplit(".", 1)
        namespace, name = qualified.split("::", 1)
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        with torch.no_grad():
            return op(
                *[replay(a, values) for a in recipe["args"]],
                **{k: replay(v, values) for k, v in recipe["kwargs"].items()},
            )
    for kind, make in (
        ("dtype", lambda s: getattr(torch, s)),
        ("device", torch.device),
        ("layout", lambda s: getattr(torch, s)),
        ("memory_format", lambda s: getattr(torch, s)),
    ):
        if kind in recipe:
            return make(recipe[kind])
    return recipe


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two constants are the same to the compiled code: dtype, shape, layout, strides and every byte
    (a oneDNN blocked tensor compared by its raw buffer, as AOTInductor reads it)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.is_mkldnn != b.is_mkldnn:
        return False
    if a.is_mkldnn:
        import ctypes

        n = torch.ops.mkldnn._nbytes(a)
        if n != torch.ops.mkldnn._nbytes(b):
            return False
        return ctypes.string_at(torch.ops.mkldnn.data_ptr(a), n) == ctypes.string_at(
            torch.ops.mkldnn.data_ptr(b), n
        )
    if a.stride() != b.stride():
        return False
    # flattened first: a 0-d tensor (a lowering's literal) has no byte view of its own
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def match_folded(
    folded: Mapping[str, tuple[Any, torch.Tensor]], sources: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], list[str]]:
    """``({name: recipe}, unmatched)``: the folded constants whose recipe, replayed on ``sources``, gives back
    every bit of what the compile folded; the others (no recipe, a source that is not a program constant, other
    bits) are unmatched."""
    recipes: dict[str, Any] = {}
    unmatched: list[str] = []
    for name, (recipe, value) in folded.items():
        ok = recipe is not None and recipe_sources(recipe) <= set(sources)
        if ok:
            again = replay(recipe, sources)
            ok = isinstance(again, torch.Tensor) and same_bits(again, value)
        if ok:
            recipes[name] = recipe
        else:
            unmatched.append(name)
    return recipes, unmatched
