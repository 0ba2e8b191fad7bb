"""``precast generate DIR --chat TEXT`` (issue 49 item 4): the message through the folder's chat template, the
answer streamed as text until the template's end-of-turn token (not printed), on a folder laid out as export-llm
writes it (program.pt2, the tokenizer's files, export.json with the end-of-sequence token), built here with a
decoder that counts up (tests/llm/chat_fixtures.py); every bad input one line with exit status 2."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import precast
from precast.cli import main
from tests.llm.chat_fixtures import CHATML, EOS, IM_END, PARIS, USER, counting_program, tokenizer_folder

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _folder(root: Path, template: str | None = CHATML) -> Path:
    from precast.llm.folder_write import write_manifest

    folder = tokenizer_folder(root, template)
    torch.export.save(counting_program(), folder / "program.pt2")
    write_manifest(folder, {"stop_tokens": [EOS], "files": {"program": "program.pt2"}})
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("chat") / "dir")


def _run(capsys, *argv):
    try:
        code = main(["generate", *map(str, argv)])
    except SystemExit as exc:  # argparse's own refusals exit from main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_answers_until_the_end_of_turn(folder, capsys):
    code, out, err = _run(capsys, folder, "--chat", "w5", "--max-new-tokens", 8, "--backend", "eager")
    assert code == 0, err
    # the counting decoder answers Paris then <|im_end|>: the end-of-turn token stops (export.json names only
    # <|endoftext|>) and is not printed
    assert out == "Paris\n"
    assert "2 new tokens (stop_token) after a prompt of 6" in err
    # --stop-tokens replaces the chat's stop tokens: past <|im_end|> to <|endoftext|>, neither printed
    argv = [folder, "--chat", "w5", "--max-new-tokens", 8, "--backend", "eager", "--stop-tokens", EOS]
    code, out, err = _run(capsys, *argv)
    assert code == 0 and out == "Paris\n" and "3 new tokens (stop_token)" in err


# the generation prompt opens a turn without naming its role: the counting decoder then answers
# <|im_start|> + 1 ... up to <|im_end|>, a ten-token answer
OPENING = CHATML.replace("<|im_start|>assistant {% endif %}", "<|im_start|>{% endif %}")
ANSWER = ["user", " system", *(f" w{i}" for i in range(4, 10)), " assistant", " Paris"]


@pytest.fixture(scope="module")
def opening(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("chat") / "opening", template=OPENING)


def test_the_tokens_are_the_apis(opening, capsys):
    """The CLI's prompt and stop tokens are precast.generate(messages=...)'s."""
    messages = [{"role": "user", "content": "w7 w8"}]
    want = precast.generate(counting_program(), messages=messages, tokenizer=opening, max_new_tokens=16)
    assert want.new_tokens == [*range(USER, PARIS + 1), IM_END] and want.prompt_length == 6
    code, out, err = _run(capsys, opening, "--chat", "w7 w8", "--max-new-tokens", 16, "--backend", "eager")
    assert code == 0 and "11 new tokens (stop_token) after a prompt of 6" in err
    assert out == "".join(ANSWER) + "\n"


class _Writes:
    """stdout that records each write and whether a flush followed it."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushed: list[int] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushed.append(len(self.writes))


def test_the_answer_streams_token_by_token(opening, monkeypatch):
    writes = _Writes()
    monkeypatch.setattr(sys, "stdout", writes)
    argv = ["generate", str(opening), "--chat", "w7 w8", "--max-new-tokens", "16", "--backend", "eager"]
    assert main(argv) == 0
    # one write per token as it came, each flushed; nothing for <|im_end|>; then the closing newline
    assert writes.writes == [*ANSWER, "\n"]
    assert writes.flushed[: len(ANSWER)] == list(range(1, len(ANSWER) + 1))


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("chat") / "bare", template=None)


@pytest.fixture(scope="module")
def refusing(tmp_path_factory) -> Path:
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('give a system message first') }}{% endif %}"
    return _folder(tmp_path_factory.mktemp("chat") / "refusing", template=template)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["{bare}", "--chat", "w5"], r"has no chat template .*not a chat model"),
        (["{dir}/program.pt2", "--chat", "w5"], "--chat needs a chat template: give the folder"),
        (["{refusing}", "--chat", "w5"], r"refused the messages \(give a system message first\)"),
        (["{dir}", "--chat", " ".join(["w5"] * 40)], "the program's cache holds 32"),
        (["{dir}", "--chat", "w5", "--prompt", "w5"], "not allowed with argument"),
    ],
)
def test_bad_inputs_one_line_exit_2(folder, bare, refusing, capsys, argv, match):
    argv = [a.format(dir=folder, bare=bare, refusing=refusing) for a in argv]
    code, out, err = _run(capsys, *argv, "--max-new-tokens", 2, "--backend", "eager")
    assert code == 2 and out == ""
    # one error line (argparse prints its usage first; a folder's engine may say which it opened first)
    errors = [line for line in err.strip().splitlines() if "error: " in line]
    assert "Traceback" not in err and len(errors) == 1 and re.search(match, errors[0]), err
