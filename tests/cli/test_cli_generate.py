"""``precast generate``: the tokens of ``precast.generate`` on the same program (eager and AOTInductor, the
session's compile of ``tests.models.TinyDecoder``), text through a local tokenizer.json, and every bad input one
line with exit status 2 before anything compiles."""

from __future__ import annotations

import pytest
import torch

import precast
from precast.cli import main

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def saved(tiny_decoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "decoder.pt2"
    torch.export.save(tiny_decoder, path)
    return path


def _run(capsys, *argv):
    try:
        code = main(["generate", *map(str, argv)])
    except SystemExit as exc:  # argparse's own refusals exit from main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_eager_prints_the_apis_tokens(saved, tiny_decoder, capsys):
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=4).new_tokens
    code, out, err = _run(capsys, saved, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--backend", "eager")
    assert code == 0 and out.strip() == ",".join(map(str, want))
    assert "4 new tokens (max_new_tokens) after a prompt of 3" in err
    sampled = precast.generate(tiny_decoder, PROMPT, max_new_tokens=4, temperature=1.5, seed=2).new_tokens
    argv = [saved, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--backend", "eager"]
    code, out, _ = _run(capsys, *argv, "--temperature", 1.5, "--seed", 2)
    assert code == 0 and out.strip() == ",".join(map(str, sampled))


@pytest.mark.aoti
def test_aoti_prints_the_apis_tokens(saved, tiny_decoder, compiled_decoder, aoti_cache, capsys):
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=5).new_tokens
    code, out, _ = _run(
        capsys, saved, "--prompt-ids", "1,2,3", "--max-new-tokens", 5, "--cache-dir", aoti_cache
    )
    assert code == 0 and out.strip() == ",".join(map(str, want))


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(32)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_text_through_a_tokenizer_json(saved, tiny_decoder, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    _tokenizer(tmp_path / "tokenizer.json")
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=4).new_tokens
    argv = ["--max-new-tokens", 4, "--backend", "eager", "--tokenizer", tmp_path / "tokenizer.json"]
    code, out, _ = _run(capsys, saved, "--prompt", "w1 w2 w3", *argv)
    assert code == 0 and out.split() == [f"w{t}" for t in want]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prompt-ids", "1,x", "--max-new-tokens", "2"], "--prompt-ids '1,x': give integer token ids >= 0"),
        (["--prompt-ids", "1,-2", "--max-new-tokens", "2"], "token ids >= 0"),
        (["--prompt-ids", "1,2,3", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (
            ["--prompt-ids", "1,2,3", "--max-new-tokens", "7"],
            "need 9 cache positions; the program's cache holds 8",
        ),
        (["--prompt", "w1", "--max-new-tokens", "2"], "--prompt is text: give --tokenizer"),
        (
            ["--prompt", "w1", "--tokenizer", "{d}/nope.json", "--max-new-tokens", "2"],
            "nope.json: no such file",
        ),
        (["--prompt", "w1", "--tokenizer", "{src}", "--max-new-tokens", "2"], "not a tokenizer.json"),
        (["--prompt-ids", "1", "--max-new-tokens", "2", "--backend", "eager", "--weights", "x"], "aoti only"),
        (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "0"], "temperature=0.0"),
    ],
)
def test_bad_inputs_one_line_exit_2(saved, tmp_path, capsys, argv, match):
    argv = [a.format(d=tmp_path, src=saved) for a in argv]
    if "--backend" not in argv:
        argv += ["--backend", "eager"]  # nothing here may compile: the checks come first
    code, out, err = _run(capsys, saved, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and match in err, err


# ---- issue 40: every flag checked before the program runs or compiles, on every backend ----------------------
BAD_FLAGS = [
    (["--prompt-ids", "1,,2"], "--prompt-ids '1,,2': give integer token ids >= 0 (ASCII digits)"),
    (["--prompt-ids", "1_0"], "--prompt-ids '1_0': give integer token ids"),
    (["--prompt-ids", "\u0661,2"], "give integer token ids >= 0 (ASCII digits)"),  # ARABIC-INDIC DIGIT ONE
    (["--prompt-ids", "1,2,"], "--prompt-ids '1,2,'"),
    (["--prompt-ids", ""], "--prompt-ids '': give integer token ids"),
    (["--prompt-ids", "1,200"], "--prompt-ids[1] = 200 is outside the vocabulary, which has 32 ids (0..31)"),
    (["--prompt-ids", str(2**66)], f"--prompt-ids[0] = {2**66} is outside the vocabulary"),
    (["--prompt-ids", "1", "--seed", str(2**70)], f"seed={2**70}; give an int in"),
    (["--prompt-ids", "1", "--seed", "1_0"], "argument --seed: invalid int value: '1_0' (ASCII digits)"),
    (["--prompt-ids", "1", "--top-k", "\u0662"], "argument --top-k: invalid int value"),
    (["--prompt-ids", "1", "--stop-tokens", "2,,3"], "--stop-tokens '2,,3'"),
    (["--prompt-ids", "1", "--temperature", "nan"], "temperature=nan"),
]


@pytest.mark.parametrize("backend", ["eager", "aoti", "openvino"])
@pytest.mark.parametrize("argv, match", BAD_FLAGS, ids=[str(i) for i in range(len(BAD_FLAGS))])
def test_bad_flags_one_line_exit_2_before_any_compile(saved, tmp_path, capsys, backend, argv, match):
    """Exit 2, one line on stderr, nothing on stdout, and nothing compiled (an empty cache folder stays empty):
    before the fix an id outside the vocabulary generated tokens on OpenVINO (exit 0) and failed after the compile
    and the prefill on AOTInductor (57 lines of C++ frames); "1,,2", "1_0" and other scripts' digits were read as
    ids; --seed 2**70 raised ValueError with a traceback."""
    cache = tmp_path / "cache"
    cache.mkdir()
    extra = ["--cache-dir", cache] if backend == "aoti" else []
    code, out, err = _run(capsys, saved, *argv, "--max-new-tokens", 2, "--backend", backend, *extra)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and match in err and "Traceback" not in err, err
    assert not any(cache.iterdir())


def test_tiny_temperature_generates_the_greedy_tokens(saved, tiny_decoder, capsys):
    """--temperature 1e-40 is a valid temperature (> 0): the draws degenerate to the argmax (before the fix the
    scores overflowed and multinomial raised after the prefill)."""
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=4).new_tokens
    argv = ["--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--backend", "eager", "--temperature", "1e-40"]
    code, out, err = _run(capsys, saved, *argv, "--seed", 0)
    assert code == 0 and out.strip() == ",".join(map(str, want)), err


def test_spaces_around_the_commas_are_allowed(saved, tiny_decoder, capsys):
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=3).new_tokens
    code, out, _ = _run(
        capsys, saved, "--prompt-ids", " 1, 2 ,3", "--max-new-tokens", 3, "--backend", "eager"
    )
    assert code == 0 and out.strip() == ",".join(map(str, want))


@pytest.mark.aoti
def test_aoti_refuses_ids_outside_the_vocabulary_of_a_cached_model(
    saved, compiled_decoder, aoti_cache, capsys
):
    """With the package already in the cache (nothing to compile), an id outside the vocabulary is still one line
    before the prefill."""
    argv = ["--prompt-ids", "1,32", "--max-new-tokens", 2, "--cache-dir", aoti_cache]
    code, out, err = _run(capsys, saved, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--prompt-ids[1] = 32 is outside" in err, err
