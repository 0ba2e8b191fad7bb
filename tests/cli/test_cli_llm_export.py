"""``precast export-llm`` (issue 41 item 4): a transformers checkpoint folder (a tiny seeded Llama saved with
``save_pretrained`` beside a BPE tokenizer trained here) or a GGUF file, exported with transformers' static-cache
recipe, converted with int8 weights or a measured ``--bits`` budget, written as one folder; generation from the
folder, the plan reapplied, and every bad input one line with exit status 2 and nothing written.

The export (~10 s here) runs for real once per checkpoint and cache length; later runs of the command in this file
reuse that program (``exports``), so what they test is the command's conversion and writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import precast
from precast.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CACHE = 32
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model reads a tiny text and writes a tiny answer",
    "precast converts programs ahead of time and casts the weights once",
    "the cache holds the keys and the values of every position",
]
TEXT = "\n".join(SENTENCES * 6)
PROMPT = "the quick brown fox"


def _run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(["export-llm", *map(str, argv)])
    except SystemExit as exc:  # argparse's own refusals exit from main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _generate(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _tokenizer(vocab: int = 120):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A folder as save_pretrained writes it: config.json, model.safetensors, tokenizer.json + its config."""
    folder = tmp_path_factory.mktemp("llm") / "model"
    save_checkpoint(folder)
    (folder.parent / "calibration.txt").write_text(TEXT)
    return folder


def save_checkpoint(folder: Path, vocab: int = 120, sharpen: float = 1.0) -> None:
    """A seeded tiny Llama and a BPE tokenizer (``vocab`` at most) trained on ``SENTENCES``, saved as
    save_pretrained writes them; ``sharpen``: the head's weights scaled (a sharper next-token distribution than the
    init's near-uniform one)."""
    tok = _tokenizer(vocab)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=tok.get_vocab_size(),
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def exports():
    """The recipe's export run once per (checkpoint, cache length) in this file, then reused."""
    from precast.llm import checkpoint as ckpt

    done: dict = {}
    real = ckpt.export_decoder

    def once(model, max_cache_len):
        key = (str(model.config._name_or_path), max_cache_len)
        if key not in done:
            done[key] = real(model, max_cache_len)
        return done[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(ckpt, "export_decoder", once)
    yield done
    patch.undo()


@pytest.fixture(scope="module")
def int8(checkpoint, exports, tmp_path_factory):
    """export-llm --weight-format int8 into an empty folder that exists already."""
    out = tmp_path_factory.mktemp("int8") / "artifact"
    out.mkdir()
    code = main(
        [
            "export-llm",
            str(checkpoint),
            "-o",
            str(out),
            "--weight-format",
            "int8",
            "--max-cache-len",
            str(CACHE),
        ]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def budget(checkpoint, exports, tmp_path_factory):
    """export-llm --bits 6 measured on the text (two windows of 16 tokens, 2 probes), with OpenVINO IR."""
    out = tmp_path_factory.mktemp("budget") / "artifact"
    backends = ["--backend", "openvino"] if _has_openvino() else []
    argv = [
        str(checkpoint),
        "-o",
        str(out),
        "--bits",
        "6",
        "--calibration-text",
        checkpoint.parent / "calibration.txt",
    ]
    argv += [
        "--calibration-window",
        "16",
        "--calibration-tokens",
        "32",
        "--probes",
        "2",
        "--max-cache-len",
        CACHE,
    ]
    code = main(["export-llm", *map(str, argv), *backends])
    assert code == 0
    return out


def _has_openvino() -> bool:
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def _outputs(program: torch.export.ExportedProgram, ids: list[int]) -> torch.Tensor:
    from precast.llm.generate import ProgramModel

    model = ProgramModel(program)  # a private cache from position 0
    return model(input_ids=torch.tensor([ids]), cache_position=torch.arange(len(ids)))


# ---- the artifact -------------------------------------------------------------------------------------------
def test_int8_writes_the_artifact(int8):
    names = {p.name for p in int8.iterdir()}
    assert names == {
        "program.pt2",
        "tokenizer.json",
        "tokenizer_config.json",
        "plan.json",
        "report.json",
        "export.json",
    }
    assert not _leftovers(int8.parent)
    report = json.loads((int8 / "report.json").read_text())
    formats = {r["weight"]: r["format"] for r in report["weight_formats"]}
    assert len(formats) == 2 * 7 + 2 and set(formats.values()) == {"int8"}  # 7 linears a layer, table, head
    assert report["policy"] == "torch" and report["dtype"] == "bf16" and report["cache"]["dtype"] == "bf16"
    plan = json.loads((int8 / "plan.json").read_text())
    assert plan["weights"] == formats
    manifest = json.loads((int8 / "export.json").read_text())
    assert manifest["max_cache_len"] == CACHE and manifest["stop_tokens"] == [2]
    assert manifest["weights"] == {"format": ["int8"]}
    program = torch.export.load(int8 / "program.pt2")
    stored = [t.dtype for t in [*program.state_dict.values(), *program.constants.values()] if t.dim() == 2]
    assert stored.count(torch.int8) == len(formats)  # the weights are stored int8 in the program itself


def test_generation_from_the_folder_is_the_in_memory_conversions(int8, checkpoint, exports, capsys):
    from tokenizers import Tokenizer

    ep = exports[(str(checkpoint), CACHE)]
    res = precast.convert(ep, policy="torch", dtype=torch.bfloat16, cache_dtype="bf16", weight_format="int8")
    saved = torch.export.load(int8 / "program.pt2")
    assert torch.equal(_outputs(res.program, [5, 6, 7, 8]), _outputs(saved, [5, 6, 7, 8]))
    want = precast.generate(res.program, [5, 6, 7], max_new_tokens=8, stop_tokens=[2]).new_tokens
    argv = ["--prompt-ids", "5,6,7", "--max-new-tokens", 8, "--stop-tokens", "2", "--backend", "eager"]
    code, out, err = _generate(capsys, int8 / "program.pt2", *argv)
    assert code == 0 and out.strip() == ",".join(map(str, want)), err
    # the folder: its program, its tokenizer.json (text out) and its end-of-sequence token as the stop token
    tok = Tokenizer.from_file(str(int8 / "tokenizer.json"))
    argv = ["--prompt-ids", "5,6,7", "--max-new-tokens", 8, "--backend", "eager"]
    code, out, _ = _generate(capsys, int8, *argv)
    assert code == 0 and out.rstrip("\n") == tok.decode(want)
    ids = tok.encode(PROMPT).ids
    want = precast.generate(res.program, ids, max_new_tokens=6, stop_tokens=[2]).new_tokens
    code, out, _ = _generate(capsys, int8, "--prompt", PROMPT, "--max-new-tokens", 6, "--backend", "eager")
    assert code == 0 and out.rstrip("\n") == tok.decode(want)


def test_a_budget_is_measured_on_the_text(budget, exports):
    # measured on the model exported with a cache of one window (16 + 1), converted with the cache asked for
    assert {k[1] for k in exports} >= {17, CACHE}
    report = json.loads((budget / "report.json").read_text())
    b = report["weight_budget"]
    assert b["budget"] == {"bits": 6.0} and b["bits_per_weight"] <= 6.0 and b["positions"] == 2 * 16
    formats = {r["weight"]: r["format"] for r in report["weight_formats"]}
    assert set(formats.values()) == {"int8", "int4-g64"}  # 6 bits: a mix of both
    assert json.loads((budget / "plan.json").read_text())["weights"] == formats
    manifest = json.loads((budget / "export.json").read_text())
    assert manifest["weights"]["calibration"]["windows"] == 2
    if _has_openvino():
        assert (budget / "model.xml").is_file() and (budget / "model.bin").stat().st_size > 0
        assert manifest["files"]["openvino"] == "model.xml"


def test_the_plan_reapplied_gives_the_same_program(budget, checkpoint, exports, tmp_path, capsys):
    out = tmp_path / "again"
    text = checkpoint.parent / "calibration.txt"
    plan = ["--plan", budget / "plan.json", "--max-cache-len", CACHE]
    # its int4 weights were fitted on the text: without it, one line; with it, fitted the same way again
    code, _, err = _run(capsys, checkpoint, "-o", out, *plan)
    assert code == 2 and "--plan fitted" in err and "--calibration-text" in err, err
    window = ["--calibration-window", "16", "--calibration-tokens", "32"]
    code, _, err = _run(capsys, checkpoint, "-o", out, *plan, "--calibration-text", text, *window)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert not report["weight_budget"]  # nothing measured
    first = json.loads((budget / "report.json").read_text())["weight_formats"]
    assert [(r["weight"], r["format"]) for r in report["weight_formats"]] == [
        (r["weight"], r["format"]) for r in first
    ]
    from precast.llm.folder import folder_program, open_folder

    # budget's folder holds OpenVINO IR, so its program.pt2 is the graph alone: its weights are in model.bin
    a, b = (folder_program(open_folder(d)) for d in (budget, out))
    ids = list(range(3, 3 + 20))
    assert torch.equal(_outputs(a, ids), _outputs(b, ids))


# ---- GGUF ---------------------------------------------------------------------------------------------------
def _write_gguf(path: Path) -> None:
    """A tiny Llama GGUF (f32 tensors, a BPE vocabulary), as llama.cpp's converter lays one out."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    tok = json.loads(_tokenizer().to_str())
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    hidden, inner, layers, heads, kv = 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inner)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).numpy().astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv * hidden // heads, hidden)),
            ("attn_v", (kv * hidden // heads, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (inner, hidden)),
            ("ffn_up", (inner, hidden)),
            ("ffn_down", (hidden, inner)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file(tmp_path, capsys):
    pytest.importorskip("accelerate")
    (tmp_path / "src").mkdir()
    _write_gguf(tmp_path / "src" / "tiny.gguf")
    out = tmp_path / "out"
    code, _, err = _run(capsys, tmp_path / "src", "--gguf", "tiny.gguf", "-o", out, "--weight-format", "int4")
    assert code == 0, err
    assert "de-quantizing" not in err  # transformers' own progress bar held back (precast --verbose shows it)
    report = json.loads((out / "report.json").read_text())
    assert {r["format"] for r in report["weight_formats"]} == {"int4-g64"}
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["source"]["gguf"].endswith("tiny.gguf") and manifest["max_cache_len"] == 128
    assert (out / "tokenizer.json").is_file()  # the GGUF's vocabulary, saved by transformers
    code, text, err = _generate(capsys, out, "--prompt", PROMPT, "--max-new-tokens", 3, "--backend", "eager")
    assert code == 0 and "new tokens" in err


def test_gguf_without_its_packages_is_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    import importlib.util

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    code, out, err = _run(capsys, tmp_path / "m.gguf", "-o", tmp_path / "out")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "gguf missing): pip install 'precast[gguf]'" in err
    assert not (tmp_path / "out").exists()


def test_openvino_missing_is_one_line_before_the_model_loads(checkpoint, tmp_path, monkeypatch, capsys):
    from precast.backends.openvino import convert as ov_convert
    from precast.errors import PrecastError

    def missing():
        raise PrecastError(f"OpenVINO is not installed (No module named 'openvino'); {ov_convert.EXTRA}")

    monkeypatch.setattr(ov_convert, "require_openvino", missing)
    code, out, err = _run(capsys, checkpoint, "-o", tmp_path / "out", "--backend", "openvino")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--backend openvino: OpenVINO is not installed" in err and "precast[openvino]" in err
    assert not (tmp_path / "out").exists()


# ---- refusals: one line, exit 2, nothing written ------------------------------------------------------------
@pytest.fixture(scope="module")
def not_a_decoder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert") / "bert"
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    config.architectures = ["BertModel"]
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # never read: the config refuses it first
    return folder


@pytest.fixture(scope="module")
def no_tokenizer(checkpoint, tmp_path_factory) -> Path:
    import shutil

    folder = tmp_path_factory.mktemp("bare") / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "short.txt").write_text("the fox")
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00 not text")
    (folder / "full").mkdir()
    (folder / "full" / "keep.txt").write_text("keep")
    (folder / "a-file").write_text("x")
    from precast.policy.plan import FORMAT, VERSION

    plan = {"format": FORMAT, "version": VERSION, "dtype": "bf16", "policy": "rules", "fp32": []}
    (folder / "ops-plan.json").write_text(json.dumps(plan))
    return folder


REFUSALS = [
    (["{missing}"], "no such folder"),
    (["{bert}"], "a bert model (BertModel) is not a decoder-only causal LM"),
    (["{model}", "-o", "{inputs}/full"], "exists and is not empty"),
    (["{model}", "-o", "{inputs}/a-file"], "is a file; give a new or empty folder"),
    (["{model}", "-o", "{inputs}/no/such/out"], "does not exist; create it first"),
    (["{model}", "-o", "{model}"], "holds the input"),
    (
        ["{model}", "--bits", "4.5"],
        "--bits measures each weight's cost on text: give --calibration-text (a plain text file)\n",
    ),
    (["{model}", "--kld", "0", "--calibration-text", "{text}"], "--kld 0: give a number > 0"),
    (
        ["{model}", "--calibration-text", "{text}"],
        "--calibration-text applies to a budget (--bits or --kld), or to int4 formats (fitted on the text)",
    ),
    (["{model}", "--probes", "2"], "--probes applies to a budget"),
    (["{model}", "--bits", "5", "--weight-format", "int8"], "not allowed with argument"),
    (["{model}", "--weight-format", "int3"], "--weight-format int3: give 'int8' (symmetric), 'int8-asym'"),
    (
        ["{model}", "--bits", "5", "--calibration-text", "{text}", "--budget-formats", "int2"],
        "--budget-formats int2: give 'int8' (symmetric)",
    ),
    # the budget's own fields: checked by the library (WeightBudget.check), in the flags' words
    (["{model}", "--bits", "inf", "--calibration-text", "{text}"], "--bits inf: give a number > 0"),
    (
        ["{model}", "--bits", "5", "--calibration-text", "{text}", "--budget-formats", "float"],
        "--budget-formats float: name the 8/4-bit formats to choose among",
    ),
    (
        ["{model}", "--kld", "0.5", "--calibration-text", "{text}", "--probes", "0"],
        "--probes 0: give a number of backward passes >= 1",
    ),
    (["{model}", "--dtype", "int8"], "--dtype int8:"),
    (["{model}", "--max-cache-len", "4"], "--max-cache-len 4: give at least 8 positions"),
    (["{model}", "--max-cache-len", "4096"], "the model's config allows 128 positions"),
    (["{model}", "--gguf", "nope.gguf"], "--gguf {model}/nope.gguf: no such file"),
    (["{model}", "--plan", "{inputs}/ops-plan.json"], "carries no weight formats"),
    (["{model}", "--bits", "5", "--calibration-text", "{inputs}/missing.txt"], "--calibration-text"),
    (["{model}", "--bits", "5", "--calibration-text", "{inputs}/binary.txt"], "not UTF-8 text"),
    # after the model is read (its tokenizer counts the tokens)
    (["{model}", "--bits", "5", "--calibration-text", "{inputs}/short.txt"], "fewer than one window of 127"),
    (
        [
            "{model}",
            "--bits",
            "5",
            "--calibration-text",
            "{text}",
            "--max-cache-len",
            "16",
            "--calibration-window",
            "16",
        ],
        "--calibration-window 16: a window is one call, at most the cache's room (15",
    ),
    (["{model}", "--backend", "tflite"], "invalid choice: 'tflite'"),
    (
        ["{bare}", "--bits", "5", "--calibration-text", "{text}"],
        "tokenized with the model's tokenizer; {bare} has none",
    ),
]


@pytest.mark.parametrize("argv, match", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_bad_inputs_one_line_exit_2_nothing_written(
    checkpoint, not_a_decoder, no_tokenizer, inputs, tmp_path, capsys, argv, match
):
    names = dict(
        model=checkpoint,
        bert=not_a_decoder,
        bare=no_tokenizer,
        inputs=inputs,
        missing=tmp_path / "nope",
        text=checkpoint.parent / "calibration.txt",
    )
    argv = [a.format(**names) for a in argv]
    match = match.format(**names)
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out")]
    before = sorted(p.name for p in inputs.rglob("*"))
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path) and not _leftovers(inputs)
    assert sorted(p.name for p in inputs.rglob("*")) == before
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )


def test_a_failure_while_writing_leaves_nothing(checkpoint, exports, tmp_path, monkeypatch, capsys):
    """The program is written, then the tokenizer fails: no -o folder, no temporary folder left."""
    from precast.errors import PrecastError
    from precast.llm import folder_write as artifact

    def fail(stage, model):
        assert (stage / "program.pt2").is_file()
        raise PrecastError("disk on fire")

    monkeypatch.setattr(artifact, "write_tokenizer", fail)
    code, _, err = _run(capsys, checkpoint, "-o", tmp_path / "out", "--max-cache-len", CACHE)
    assert code == 2 and err.strip() == "precast export-llm: error: disk on fire"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_generate_on_a_folder_without_a_program(tmp_path, capsys):
    code, out, err = _generate(
        capsys, tmp_path, "--prompt-ids", "1", "--max-new-tokens", 1, "--backend", "eager"
    )
    assert code == 2 and out == "" and "no program.pt2 in it" in err and err.count("\n") == 1
