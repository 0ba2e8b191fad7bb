"""The LLM tier's models and references: decoder-only architectures from transformers' own configs (seeded random
weights, nothing downloaded), exported with transformers' ExecuTorch recipe
(``TorchExportableModuleForDecoderOnlyLM``: a static KV cache held in module buffers ``key_cache_<i>`` /
``value_cache_<i>``, written in place by ``index_copy_`` in ``cache_utils.StaticLayer.update``), strict, with a
dynamic sequence length so one program runs the prefill (a prompt of ``PROMPT`` tokens) and every 1-token
decode step (``cache_position`` advancing).

Everything here is a pure function of the model: the tests (``test_llm.py``) and the table script
(``python -m tests.realmodels.llm_table``) compare precast's converted programs against these references.

References per policy:
- ``None``: the unconverted program itself, run step by step (its own copy of the cache).
- ``"torch"``: eager ``torch.autocast("cpu", dtype)`` of the same model, whose cache write casts the new keys and
  values to the cache's dtype first (``cast_at_write``): eager autocast itself raises at ``index_copy_`` (the
  value arrives bf16/fp16, the cache is fp32), and a cast at the write is what precast does for a value written
  into a buffer of another dtype. With a low-precision cache (``cache_dtype``) the eager model's cache buffers
  are that dtype. The attention mask is built as under export (``mask_as_traced``).
- ``"rules"`` / ``"auto"``: the fp32 program's trajectory; the tests state cosine and greedy-token agreement.

Decode is teacher-forced: every run is fed the same tokens (the prompt, then the fp32 program's own greedy
tokens), so each step compares logits on the same inputs; a run's greedy token at a step is the argmax of its
last-position logits, and agreement counts the steps where it equals the fp32 program's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

SEED = 0
PROMPT = 6  # prefill length
DECODE = 10  # 1-token decode steps after the prefill
MAX_CACHE = 32  # the recipe's static cache length (prompt + decode fit, with room)
VOCAB = 128
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Tiny configs: hidden 64, 2 layers (gemma2 / gemma3 alternate a sliding and a full layer), GQA 4/2, head 16.
# initializer_range 0.2 (transformers' default is 0.02): with the default, these random models' logits are nearly
# flat (|logit| < 0.7) and their greedy continuations repeat one or two tokens, so token agreement would say
# little; at 0.2 the logits reach 6-10 and the continuations vary, which low precision finds harder.
_BASE = dict(
    initializer_range=0.2,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    **TOKENS,
)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},  # q_norm / k_norm (RMSNorm with to(input_dtype)) on the projections
    "mistral": {"sliding_window": None},
    "phi3": {},  # fused qkv and gate_up projections
    "olmo2": {},  # q_norm / k_norm, post-norms
    "gemma2": {"sliding_window": 16},  # hybrid cache (sliding + full layers), soft-capping, type_as norms
    "gemma3_text": {"sliding_window": 16},  # hybrid cache, q/k norms, type_as norms
}

# Which capture route is bitwise eager autocast under policy "torch", per family. "program": both routes,
# precast.convert(ep, policy="torch") of the recipe's fp32 program and precast.convert(w.model, inputs,
# policy="torch", dynamic_shapes=...) (precast traces the module under autocast); "module": only the module route,
# because the fp32 export baked dtype reads taken while tracing (RMSNorm's ``to(input_dtype)`` / ``type_as`` on
# a projection's output: bf16 in eager autocast, fp32 in the trace), so the program route is exact to the program
# and within a stated cosine of eager. Measured on every family (docs/benchmarks/llm_tier.md).
BITWISE_ROUTE = {
    "llama": "program",
    "qwen2": "program",
    "qwen3": "module",
    "mistral": "program",
    "phi3": "program",
    "olmo2": "module",
    "gemma2": "module",
    "gemma3_text": "module",
}


def cache_names(names) -> list[str]:
    """The KV cache buffers among ``names`` (the recipe's ``key_cache_<i>`` / ``value_cache_<i>``)."""
    return sorted(n for n in names if n.startswith(("key_cache_", "value_cache_")))


@dataclass
class LLM:
    """A family's model: the recipe's wrapper, its inner exportable module (``wrapper.model``, taking
    ``input_ids`` and ``cache_position``), the strict fp32 program with a dynamic sequence length, and the
    teacher-forcing tokens (prompt + the fp32 program's greedy tokens)."""

    family: str
    wrapper: torch.nn.Module
    program: ExportedProgram
    tokens: torch.Tensor  # (1, PROMPT + DECODE)
    region_programs: dict = field(default_factory=dict)

    @property
    def module(self) -> torch.nn.Module:
        return self.wrapper.model

    def example(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[:, :PROMPT], "cache_position": torch.arange(PROMPT)}


def dynamic_shapes() -> dict:
    seq = Dim("seq", min=1, max=MAX_CACHE - 1)
    return {"input_ids": {1: seq}, "cache_position": {0: seq}}


def config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **(_BASE | FAMILIES[family]))


def wrapper(family: str) -> torch.nn.Module:
    """transformers' recipe around ``AutoModelForCausalLM.from_config`` with seeded random weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config(family)).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=MAX_CACHE,
        cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE},
    )
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE).eval()


def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(3, VOCAB, (1, PROMPT), generator=g)


def export(w: torch.nn.Module, ids: torch.Tensor) -> ExportedProgram:
    """The recipe's export (strict), sequence length dynamic."""
    with torch.no_grad():
        return w.export(
            input_ids=ids, cache_position=torch.arange(ids.shape[1]), dynamic_shapes=dynamic_shapes()
        )


def build(family: str) -> LLM:
    import transformers

    transformers.logging.set_verbosity_error()
    w = wrapper(family)
    ids = prompt()
    program = export(w, ids)
    # the decode tokens: the fp32 program's own greedy continuation
    fp32 = run_program(program, ids)
    return LLM(family, w, program, torch.cat([ids, fp32.greedy[:DECODE].unsqueeze(0)], dim=1))


def region_program(llm: LLM, where: str) -> ExportedProgram:
    """The recipe's export of the same weights with part of the forward inside one
    ``torch.autocast("cpu", torch.bfloat16)`` region, as a user writes it in the model's code:
    ``"head"``: the LM head's forward; ``"forward"``: the whole causal LM's forward (the cache writes inside:
    the unconverted program itself fails at run time, at the cache's ``index_copy_`` or at a dtype assertion
    export recorded, as eager autocast fails at the write)."""
    if where not in llm.region_programs:
        w = wrapper(llm.family)
        causal_lm = w.model.model
        target = {"head": causal_lm.lm_head, "forward": causal_lm}[where]
        in_bf16_region(target)
        llm.region_programs[where] = (w, export(w, llm.tokens[:, :PROMPT]))
    return llm.region_programs[where][1]


def in_bf16_region(module: torch.nn.Module) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*args, **kwargs)

    module.forward = forward


# ---- running a model step by step ---------------------------------------------------------------------------
@dataclass
class Trajectory:
    """Per step (prefill, then each decode step): the logits, and the KV cache after the step (None where the
    runner cannot read it, e.g. a compiled package)."""

    logits: list[torch.Tensor]
    caches: list[dict[str, torch.Tensor] | None]

    @property
    def greedy(self) -> torch.Tensor:
        """The greedy next token after each step: argmax of the last position's logits."""
        return torch.stack([lg[0, -1].argmax(-1) for lg in self.logits])


def run(
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    read_cache: Callable[[], dict | None],
    tokens: torch.Tensor,
) -> Trajectory:
    """Prefill, then DECODE 1-token steps through ``call(input_ids, cache_position)``: teacher-forced on
    ``tokens`` (prompt + DECODE tokens), or free-running (each step fed the previous greedy token) when
    ``tokens`` is the prompt alone."""
    free = tokens.shape[1] == PROMPT
    if not free and tokens.shape[1] != PROMPT + DECODE:
        raise ValueError(
            f"tokens: the prompt ({PROMPT}) or prompt + decode ({PROMPT + DECODE}), got {tokens.shape}"
        )
    logits, caches = [], []
    with torch.no_grad():
        for step in range(DECODE + 1):
            if step == 0:
                ids, pos = tokens[:, :PROMPT], torch.arange(PROMPT)
            else:
                i = PROMPT + step - 1
                ids, pos = tokens[:, i : i + 1], torch.tensor([i])
            out = call(ids, pos)
            logits.append(out.detach().clone())
            caches.append(read_cache())
            if free and step < DECODE:
                tokens = torch.cat([tokens, out[:, -1:].argmax(-1)], dim=1)
    return Trajectory(logits, caches)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    bufs = dict(module.named_buffers())
    return {n: bufs[n].detach().clone() for n in cache_names(bufs)}


def run_program(program: ExportedProgram, tokens: torch.Tensor) -> Trajectory:
    """The program's module on its own copy of the program's state (``ep.module()`` shares the program's
    buffers: running it would write the caller's cache)."""
    module = copy.deepcopy(program).module()
    return run(
        lambda ids, pos: module(input_ids=ids, cache_position=pos),
        functools.partial(_buffers, module),
        tokens,
    )


def run_compiled(compiled, tokens: torch.Tensor) -> Trajectory:
    """A precast.compile'd package (it holds its own cache; the attention masks every position not yet written,
    so a package that ran before gives the same values)."""
    return run(lambda ids, pos: compiled(input_ids=ids, cache_position=pos), lambda: None, tokens)


def run_eager(
    llm: LLM,
    tokens: torch.Tensor,
    autocast: torch.dtype | None = None,
    cache_dtype: torch.dtype | None = None,
    module: torch.nn.Module | None = None,
) -> Trajectory:
    """Eager reference on a private copy of the model (the caller's cache untouched): fp32, or under
    ``torch.autocast("cpu", autocast)`` with the cache write cast to the cache's dtype (``cast_at_write``);
    ``cache_dtype``: the cache buffers stored in that dtype."""
    m = copy.deepcopy(module if module is not None else llm.module)
    if cache_dtype is not None:
        set_cache_dtype(m, cache_dtype)

    def call(ids, pos):
        ctx = (
            torch.autocast("cpu", dtype=autocast, cache_enabled=False)
            if autocast is not None
            else contextlib.nullcontext()
        )
        with ctx, cast_at_write(), mask_as_traced():
            return m(input_ids=ids, cache_position=pos)

    return run(call, functools.partial(_buffers, m), tokens)


def _cache_object(module: torch.nn.Module):
    return getattr(module, "static_cache", None) or module.cache


def set_cache_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store the recipe module's KV cache in ``dtype``: each layer's tensors and the buffers naming them."""
    for i, layer in enumerate(_cache_object(module).layers):
        layer.keys = layer.keys.to(dtype)
        layer.values = layer.values.to(dtype)
        layer.dtype = dtype
        setattr(module, f"key_cache_{i}", layer.keys)
        setattr(module, f"value_cache_{i}", layer.values)


@contextlib.contextmanager
def cast_at_write():
    """``StaticLayer.update`` with the new keys/values cast to the cache's dtype before ``index_copy_`` (the
    recipe replaces sliding-window layers by ``StaticLayer``, so this is every layer it exports)."""
    from transformers.cache_utils import StaticLayer

    original = StaticLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        if getattr(self, "keys", None) is not None:
            key_states = key_states.to(self.keys.dtype)
            value_states = value_states.to(self.values.dtype)
        return original(self, key_states, value_states, *args, **kwargs)

    StaticLayer.update = update
    try:
        yield
    finally:
        StaticLayer.update = original


@contextlib.contextmanager
def mask_as_traced():
    """transformers' attention mask built as under export: eager transformers drops the causal mask and calls
    sdpa with ``is_causal`` when no token is padded (``masking_utils._ignore_causal_mask_sdpa``), but never while
    tracing, so the program holds the explicit mask. Like a dtype read, that choice is made at trace time; the
    reference makes the one the program recorded (with it, eager fp32 and the program agree to ~1e-6, and
    eager autocast and precast's "torch" conversion bitwise)."""
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


# ---- comparing trajectories ---------------------------------------------------------------------------------
def first_difference(got: Trajectory, want: Trajectory) -> str | None:
    """None when every step's logits and caches are bitwise equal (same dtypes); else where they first differ."""
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"step {step}: logits {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        if not torch.equal(g, w):
            return f"step {step}: logits max abs diff {max_diff(g, w):.3g}"
        gc, wc = got.caches[step], want.caches[step]
        if gc is None or wc is None:
            continue
        if sorted(gc) != sorted(wc):
            return f"step {step}: cache buffers {sorted(gc)} vs {sorted(wc)}"
        for name in gc:
            if gc[name].dtype != wc[name].dtype:
                return f"step {step}: {name} {gc[name].dtype} vs {wc[name].dtype}"
            if not torch.equal(gc[name], wc[name]):
                return f"step {step}: {name} max abs diff {max_diff(gc[name], wc[name]):.3g}"
    return None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def worst_max_diff(got: Trajectory, want: Trajectory) -> float:
    return max(max_diff(g, w) for g, w in zip(got.logits, want.logits, strict=True))


def min_cosine(got: Trajectory, want: Trajectory) -> float:
    """Lowest cosine of a position's logits vs the reference's, over every position of every step."""
    from precast.metrics import row_cosine

    return min(row_cosine(g.float(), w.float()) for g, w in zip(got.logits, want.logits, strict=True))


def agreement(got: Trajectory, want: Trajectory) -> tuple[int, int]:
    """(steps whose greedy token equals the reference's, decode steps): over the DECODE tokens chosen after the
    prefill and after each decode step but the last (the teacher-forced tokens)."""
    g, w = got.greedy[:DECODE], want.greedy[:DECODE]
    return int((g == w).sum()), len(w)


def all_finite(t: Trajectory) -> bool:
    return all(bool(torch.isfinite(lg).all()) for lg in t.logits)


# ---- program invariants -------------------------------------------------------------------------------------
CASTS = (
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.prims.convert_element_type.default,
)
CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _root(node):
    """Follow views (schema ``Tensor(a)`` returns) back to the value that owns the storage."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        node = node.args[0]
    return node


def written_buffers(ep: ExportedProgram) -> dict[str, str]:
    """Buffer target -> how the program writes it: "in place (<op>)" (an op whose schema writes the buffer's
    storage) or "mutation output" (a BUFFER_MUTATION output, after run_decompositions)."""
    by_node = {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER}
    found: dict[str, str] = {}
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write or i >= len(node.args):
                continue
            root = _root(node.args[i])
            if isinstance(root, torch.fx.Node) and root.name in by_node:
                found.setdefault(by_node[root.name], f"in place ({node.target.__name__})")
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            found.setdefault(spec.target, "mutation output")
    return found


def constant_value(ep: ExportedProgram, name: str) -> torch.Tensor:
    return ep.state_dict[name] if name in ep.state_dict else ep.constants[name]


def weight_casts(ep: ExportedProgram) -> list[str]:
    """Casts, at run time, of a constant the program never writes (a weight, ``inv_freq``), directly or through
    views: work a backend would redo on every forward. Casts of the cache (a written buffer) are not counted."""
    written = set(written_buffers(ep))
    consts = {
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind in CONSTANT_KINDS and s.target not in written
    }
    found = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target not in CASTS:
            continue
        root = _root(n.args[0])
        if not isinstance(root, torch.fx.Node) or root.name not in consts:
            continue
        src, out = n.args[0].meta.get("val"), n.meta.get("val")
        if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype:
            continue  # a same-dtype .to()/.float() the model wrote (gemma's norms): no work, an alias
        found.append(f"{n.name}({root.name})")
    return found


def cache_bytes(ep: ExportedProgram) -> int:
    names = cache_names([s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER])
    return sum(constant_value(ep, n).numel() * constant_value(ep, n).element_size() for n in names)


def snapshot(ep: ExportedProgram, module: torch.nn.Module) -> dict:
    """What a conversion must leave as it was: the program's graph, signature and state, the module's state."""
    return {
        "graph": str(ep.graph),
        "signature": str(ep.graph_signature),
        "program_state": {k: v.detach().clone() for k, v in {**ep.state_dict, **ep.constants}.items()},
        "module_state": {
            k: v.detach().clone() for k, v in [*module.named_parameters(), *module.named_buffers()]
        },
    }


def snapshot_differences(before: dict, after: dict) -> list[str]:
    problems = [k for k in ("graph", "signature") if before[k] != after[k]]
    for part in ("program_state", "module_state"):
        b, a = before[part], after[part]
        if sorted(b) != sorted(a):
            problems.append(f"{part}: names {sorted(set(b) ^ set(a))}")
            continue
        problems += [f"{part}: {k}" for k in b if b[k].dtype != a[k].dtype or not torch.equal(b[k], a[k])]
    return problems
