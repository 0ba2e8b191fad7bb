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
    code = main(["generate", *map(str, argv)])
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
        (["--prompt-ids", "1,x", "--max-new-tokens", "2"], "--prompt-ids '1,x': give integer token ids"),
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
