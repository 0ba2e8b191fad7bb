"""``precast.llm.export`` (issue 51 item 3): a Python user exports an LLM folder with one call and loads it with another
(``precast.load``), the same folder ``precast export-llm`` writes from the same options (``precast export-llm`` is
that call with flags); every bad argument is one line, before anything is read or written.

The tiny seeded Llama checkpoint and its export (run once, reused) are test_cli_llm_export's fixtures."""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.cli import main
from precast.errors import PrecastError
from tests.cli.test_cli_llm_export import CACHE, PROMPT, checkpoint, exports  # noqa: F401 - the fixtures

transformers = pytest.importorskip("transformers")
EVAL = 64  # held-out tokens: enough for a record, cheap on the tiny model


def _logits(program: torch.export.ExportedProgram, ids: list[int]) -> torch.Tensor:
    from precast.llm.generate import ProgramModel

    return ProgramModel(program)(input_ids=torch.tensor([ids]), cache_position=torch.arange(len(ids)))


@pytest.fixture(scope="module")
def from_python(checkpoint, exports, tmp_path_factory):  # noqa: F811
    """One call: int8 weights, a 32-position cache, measured on 64 held-out tokens."""
    out = tmp_path_factory.mktemp("api") / "smol"
    folder = precast.llm.export(
        checkpoint, out, weight_format="int8", max_cache_len=CACHE, eval_tokens=EVAL, threads=1
    )
    return folder


@pytest.fixture(scope="module")
def from_cli(checkpoint, exports, tmp_path_factory):  # noqa: F811
    """The same export through ``precast export-llm``."""
    out = tmp_path_factory.mktemp("cli") / "smol"
    argv = [checkpoint, "-o", out, "--weight-format", "int8", "--max-cache-len", CACHE]
    assert main(["export-llm", *map(str, argv), "--eval-tokens", str(EVAL), "--threads", "1"]) == 0
    return out


def test_one_call_exports_the_folder_the_command_writes(from_python, from_cli):
    folder = from_python
    assert isinstance(folder, precast.ExportedFolder) and folder.path.is_dir()
    assert sorted(p.name for p in folder.path.iterdir()) == sorted(p.name for p in from_cli.iterdir())
    assert set(folder.files) == {"program", "report", "plan", "tokenizer"}
    ours = json.loads((folder.path / "export.json").read_text())
    theirs = json.loads((from_cli / "export.json").read_text())
    assert ours == folder.manifest  # what the call returns is what it wrote
    assert _timeless(ours) == _timeless(
        theirs
    )  # the same record, "source" included (the same checkpoint path)
    assert ours["weights"] == {"format": ["int8"]} and ours["accuracy"]["positions"] > 0
    report = json.loads((folder.path / "report.json").read_text())
    assert _timeless(report) == _timeless(json.loads((from_cli / "report.json").read_text()))
    assert folder.summary() == folder.report.summary() and "int8" in folder.summary()
    # the programs: the same logits, bitwise
    ids = list(range(3, 3 + 12))
    a = torch.export.load(folder.path / "program.pt2")
    b = torch.export.load(from_cli / "program.pt2")
    assert torch.equal(_logits(a, ids), _logits(b, ids))


def _timeless(record: dict) -> dict:
    """A JSON record without what the clock wrote (every ``seconds``)."""
    if isinstance(record, dict):
        return {k: _timeless(v) for k, v in record.items() if k != "seconds"}
    if isinstance(record, list):
        return [_timeless(v) for v in record]
    return record


def test_another_call_loads_it_and_generates_the_commands_tokens(from_python, from_cli, checkpoint, exports):  # noqa: F811
    llm = from_python.load(backend="eager")
    assert isinstance(llm, precast.LLM)
    got = llm.generate(PROMPT, max_new_tokens=8)
    want = precast.load(from_cli, backend="eager").generate(PROMPT, max_new_tokens=8)
    assert got.new_tokens == want.new_tokens and len(got.new_tokens) > 0
    # and the reference: the in-memory conversion of the same export, generated from the same prompt ids
    ep = exports[(str(checkpoint), CACHE)]
    res = precast.convert(ep, policy="torch", dtype=torch.bfloat16, cache_dtype="bf16", weight_format="int8")
    ids = llm.tokenizer.encode(PROMPT).ids
    ref = precast.generate(res.program, ids, max_new_tokens=8, stop_tokens=llm.stop_tokens).new_tokens
    assert got.new_tokens == ref
    assert precast.export_llm is precast.llm.export


def test_a_budget_from_python_is_measured_on_the_text(checkpoint, exports, tmp_path):  # noqa: F811
    """``weight_format=precast.WeightBudget(bits=6)`` without data: measured on ``calibration_text``'s windows,
    as ``--bits 6 --calibration-text`` is."""
    text = checkpoint.parent / "calibration.txt"
    common = dict(max_cache_len=CACHE, calibration_window=16, calibration_tokens=32, eval_tokens=0)
    folder = precast.llm.export(
        checkpoint,
        tmp_path / "api",
        weight_format=precast.WeightBudget(bits=6, probes=2),
        calibration_text=text,
        **common,
    )
    argv = [checkpoint, "-o", tmp_path / "cli", "--bits", 6, "--calibration-text", text, "--probes", 2]
    argv += ["--max-cache-len", CACHE, "--calibration-window", 16, "--calibration-tokens", 32]
    assert main(["export-llm", *map(str, argv), "--eval-tokens", "0"]) == 0
    plan = json.loads((folder.path / "plan.json").read_text())["weights"]
    assert set(plan.values()) == {"int8", "int4-g64"}  # 6 bits: a mix of both
    assert plan == json.loads((tmp_path / "cli" / "plan.json").read_text())["weights"]
    weights = folder.manifest["weights"]
    assert weights["budget"] == {"bits": 6} and weights["calibration"]["windows"] == 2
    assert folder.report.weight_budget["bits_per_weight"] <= 6.0


def test_int4_with_text_is_fitted_on_it(checkpoint, exports, tmp_path):  # noqa: F811
    """``weight_format="int4"`` with ``calibration_text``: the int4 weights fitted on the text's windows
    (data-aware int4, as ``--weight-format int4 --calibration-text`` does); before, the text was refused."""
    from precast.quant.rounding import GPTQ, SEARCH

    text = checkpoint.parent / "calibration.txt"
    common = dict(max_cache_len=CACHE, calibration_window=16, calibration_tokens=32, eval_tokens=0)
    folder = precast.llm.export(
        checkpoint, tmp_path / "api", weight_format="int4", calibration_text=text, **common
    )
    roundings = {r["rounding"].split(" ")[0] for r in folder.report.weight_formats}
    assert roundings & {GPTQ, SEARCH} and roundings <= {
        GPTQ,
        SEARCH,
        "rtn",
    }  # 32 rows: the search (fit.GPTQ_ROWS)
    weights = folder.manifest["weights"]
    assert weights["format"] == ["int4"] and weights["calibration"]["windows"] == 2
    plan = json.loads((folder.path / "plan.json").read_text())
    assert {v.split(" ")[0] for v in plan["roundings"].values()} <= {GPTQ, SEARCH} and plan["roundings"]


REFUSALS = [
    (dict(backend="tflite"), "backend='tflite': an LLM folder holds openvino or aoti"),
    (
        dict(backend="onnx"),
        "backend='onnx': precast.compile's engine 'onnx' runs no LLM folder; an LLM folder",
    ),
    (dict(backend=["aoti", 3]), "backend=['aoti', 3]: give 'openvino', 'aoti'"),
    (dict(eval_tokens=-1), "eval_tokens=-1: give a number >= 0 (0: not measured)"),
    (dict(max_cache_len=4), "max_cache_len=4: give at least 8 positions"),
    (dict(max_cache_len=4096), "max_cache_len=4096: the model's config allows 128 positions"),
    (dict(calibration_window=0), "calibration_window=0: give a number >= 1"),
    (dict(threads=0), "threads=0: give a thread count >= 1"),
    (
        dict(calibration_text="{text}"),
        "calibration_text= applies to a weight budget measured on text (weight_format=precast.WeightBudget(...) "
        "without data=), or to int4 formats (fitted on the text)",
    ),
    (dict(calibration_text="{text}", weight_format="int8"), "calibration_text= applies to a weight budget"),
    (
        dict(weight_format=precast.WeightBudget(bits=5)),
        "a weight budget (weight_format=) measures each weight's cost on text: give calibration_text=",
    ),
    (
        dict(weight_format=precast.WeightBudget(bits=-1), calibration_text="{text}"),
        "WeightBudget: bits=-1: give a number > 0",
    ),
    (dict(weight_format="int3"), "weight_format='int3': give 'int8' (symmetric)"),
    (dict(dtype="int8"), "dtype='int8'"),
    (
        dict(plan="{plan}", weight_format="int8"),
        "plan= and weight_format=: the weights' formats come from one",
    ),
    (dict(calibration_text="{missing}", weight_format=precast.WeightBudget(bits=5)), "calibration_text= "),
    (dict(source="{missing}"), "no such folder"),
    (dict(out_dir=3), "out_dir=3: give a path (a str or a pathlib.Path)"),
    (dict(out_dir="{text}"), "is a file; give a new or empty folder"),
]


@pytest.mark.parametrize("kw, match", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_a_bad_argument_is_one_line_and_nothing_is_written(checkpoint, tmp_path, kw, match):  # noqa: F811
    names = dict(
        text=checkpoint.parent / "calibration.txt",
        missing=tmp_path / "nope.txt",
        plan=tmp_path / "plan.json",
    )
    from precast.policy.plan import FORMAT, VERSION

    plan = {"format": FORMAT, "version": VERSION, "dtype": "bf16", "policy": "rules", "fp32": []}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    kw = {k: (v.format(**names) if isinstance(v, str) else v) for k, v in kw.items()}
    source, out = kw.pop("source", checkpoint), kw.pop("out_dir", tmp_path / "out")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(PrecastError) as info:
        precast.llm.export(source, out, **kw)
    message = str(info.value)
    assert "\n" not in message and match in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no temporary folder


def test_the_command_and_the_call_share_their_defaults():
    """The flags' defaults are the library's (one home: precast.llm.export_options)."""
    import inspect

    from precast.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["export-llm", "m", "-o", "out"])
    sig = inspect.signature(precast.llm.export).parameters
    for name in (
        "eval_tokens",
        "calibration_tokens",
        "calibration_window",
        "max_cache_len",
        "dtype",
        "cache_dtype",
    ):
        assert getattr(args, name) == sig[name].default, name


def test_the_engines_a_folder_holds_are_the_registrys_stateful_ones():
    """One module lists the engines (precast.backends.registry): a folder holds an artifact of engines that run a
    KV cache there, and export-llm's choices are exactly those."""
    from precast.backends.registry import stateful_names
    from precast.llm.export_options import BACKENDS
    from precast.llm.folder import HELD

    assert BACKENDS == HELD
    assert set(HELD) <= set(stateful_names())
