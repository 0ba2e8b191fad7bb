"""torch.compile serves a converted program: same outputs, and no per-call weight casts in inductor's code.

How "no per-call weight casts" is checked (``compile_and_inspect``): a dynamo backend wraps inductor's
``compile_fx``. It knows which graph inputs are the module's weights (their storage is a parameter's or buffer's:
``data_ptr`` identity, no naming convention) and installs a post-grad pass hook, which sees the exact graph
inductor lowers to code (inference graphs keep the dynamo graph's input order). A weight cast per call is a
``prims.convert_element_type`` / ``aten._to_copy`` whose input is a weight placeholder, directly or through view
ops (``permute``, ``t``, ``view``...). As a second, textual check on the generated wrapper: no kernel call whose
name marks a cast (``cpp_fused__to_copy_*``) takes a weight argument. Both checks find the casts in the same
model compiled with eager autocast (the positive control), so they can fail.

Tolerance: with ``torch._inductor.config.emulate_precision_casts = True`` (inductor rounds each fused
intermediate to its low-precision dtype, as eager does) outputs are bitwise equal for the MLP and the CNN. With the
default (False) inductor keeps fused bf16 intermediates in fp32: the CNN differs by up to 2 bf16 ulps at the
output's magnitude. The encoder ends in an fp32 LayerNorm whose reduction inductor orders differently: <= 1e-6.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

import precast
from tests import models as zoo

CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
VIEWS = {"view", "reshape", "_unsafe_view", "permute", "t", "transpose", "expand", "slice", "select",
         "unsqueeze", "squeeze", "alias", "as_strided", "clone"}  # fmt: skip
CAST_KERNEL = re.compile(r"^\s*(\w*(?:_to_copy|convert_element_type)\w*)\((.*)\)\s*$")


def _op_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


ALLOC = re.compile(r"^\s*(buf\d+) = empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), (torch\.\w+)\)")


def compile_and_inspect(module: torch.nn.Module, inputs: tuple, **configs):
    """(outputs, weight casts in the post-grad graph, cast kernels fed a weight in the generated code)."""
    weights = {t.data_ptr() for t in [*module.parameters(), *module.buffers()] if t.numel()}
    seen: dict = {"graph": [], "weights": {}}

    def backend(gm, example_inputs):
        positions = {
            i: t
            for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and t.data_ptr() in weights
        }

        def hook(graph: torch.fx.Graph) -> None:
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            names = {placeholders[i].name: t for i, t in positions.items()}
            seen["weights"] = {n: (t.numel(), str(t.dtype)) for n, t in names.items()}
            for node in graph.nodes:
                if node.target in CASTS:
                    src = node.args[0]
                    while src.op == "call_function" and _op_name(src) in VIEWS:
                        src = src.args[0]
                    if src.name in names:
                        seen["graph"].append(f"{node.name}({src.name})")

        with inductor_config.patch(post_grad_custom_post_pass=hook, **configs):
            return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, *inputs)
    assert seen["weights"], "no weight was found among the compiled graph's inputs"
    return out, seen["graph"], cast_kernels_on_weights(codes, seen["weights"])


def cast_kernels_on_weights(codes: list[str], weights: dict[str, tuple[int, str]]) -> list[str]:
    """Kernel calls in the wrapper's ``call`` named for a cast that take a weight argument and write a buffer of
    the weight's size in another dtype. (A kernel fused with the input's cast may also copy a weight into another
    layout, dtype unchanged: inductor's channels-last conv weight without freezing. That is a copy, not a cast.)"""
    found = []
    for code in codes:
        allocs: dict[str, tuple[int, str]] = {}
        for line in code.split("def call(", 1)[-1].splitlines():
            a = ALLOC.match(line)
            if a:
                dims = [int(d) for d in a.group(2).replace(" ", "").split(",") if d]
                allocs[a.group(1)] = (int(torch.tensor(dims).prod()) if dims else 1, a.group(3))
            m = CAST_KERNEL.match(line)
            if not m:
                continue
            args = re.findall(r"\w+", m.group(2))
            for w in set(args) & set(weights):
                numel, dtype = weights[w]
                if any(allocs.get(b, (None, None))[0] == numel and allocs[b][1] != dtype for b in args):
                    found.append(f"{m.group(1)}({w})")
    return found


CASES = {"small_mlp": (0.0, 0.0), "cnn": (2.0, 0.0), "encoder": (None, None)}  # ulps: default, emulated


@pytest.mark.parametrize("name", list(CASES))
def test_same_outputs_no_weight_casts(name):
    model, inputs = getattr(zoo, name)()
    res = precast.convert(model, inputs)
    module = res.program.module()
    with torch.no_grad():
        ref = module(*inputs)
    default_ulps, emulated_ulps = CASES[name]
    for configs, ulps in (({}, default_ulps), ({"emulate_precision_casts": True}, emulated_ulps)):
        out, graph_casts, kernels = compile_and_inspect(module, inputs, **configs)
        assert graph_casts == [] and kernels == [], (graph_casts, kernels)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        diff = (out - ref).abs().max().item()
        if ulps is None:  # fp32 output of an fp32 LayerNorm, reduction reordered
            assert diff <= 1e-6, diff
        elif ulps == 0:
            assert torch.equal(out, ref), diff
        else:
            assert diff <= ulps * torch.finfo(torch.bfloat16).eps * ref.abs().max().item(), diff
        if name != "small_mlp":
            break  # one config is enough for the larger models (time)


def test_check_finds_eager_autocast_weight_casts():
    """The positive control: the model as written casts its fp32 weights to bf16 on every forward."""
    model, inputs = zoo.small_mlp()
    _, graph_casts, kernels = compile_and_inspect(model, inputs)
    assert len(graph_casts) == 8  # 4 weights + 4 biases
    assert kernels, "the generated code should show cast kernels reading the weights"


def test_bert_real_model():
    """The real-model tier's BERT (transformers, built from a config), bf16 under policy torch: torch.compile
    of the converted program computes what the program computes (within 2 bf16 ulps of the output's scale:
    Inductor fuses and reorders) and reads its bf16 weights as they are, no per-call casts."""
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'precast[test]')")
    from tests.realmodels.builders import bert
    from tests.realmodels.conftest import export

    built = bert()
    inputs = built.inputs[2]
    program = export(built.make(False), inputs)
    res = precast.convert(program, inputs, policy="torch", dtype=torch.bfloat16)
    module = res.program.module()
    with torch.no_grad():
        ref = module(*inputs)
    out, graph_casts, kernels = compile_and_inspect(module, inputs)
    assert graph_casts == [] and kernels == [], (graph_casts, kernels)
    out, ref = torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == r.dtype and o.shape == r.shape
        scale = r.abs().max().item()
        assert (o.float() - r.float()).abs().max().item() <= 2 * torch.finfo(torch.bfloat16).eps * scale
