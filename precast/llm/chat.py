"""Chat: a conversation turned into the prompt an instruction-tuned decoder was trained on (its chat template, run
by transformers' ``apply_chat_template``: jinja2 in transformers' sandbox, the template's own special tokens), and
the tokens that end the assistant's turn.

    chat = chat_template("smol/")                 # the folder precast export-llm wrote, or a transformers tokenizer
    ids = chat.prompt([{"role": "user", "content": "What is the capital of France?"}])
    res = precast.generate(model, ids, max_new_tokens=64, stop_tokens=chat.stop_tokens)
    chat.reply(res.new_tokens)                    # the answer's text, without the end-of-turn token
    # the same in one call: precast.generate(model, messages=[...], tokenizer="smol/", max_new_tokens=64)

Where the template lives: a folder export-llm wrote holds the checkpoint's tokenizer files as they were
(``tokenizer_config.json``, whose ``chat_template`` older checkpoints carry, and ``chat_template.jinja``), or, for
a GGUF, what transformers' ``save_pretrained`` writes of the tokenizer it read (``chat_template.jinja``).
``AutoTokenizer.from_pretrained(folder)`` reads either; a folder without a template is refused in one line.

Stop tokens (``stop_tokens``): the ones given (export.json's, the checkpoint's end-of-sequence ids), the
tokenizer's ``eos_token_id``, and the template's end-of-turn token: the special token the template writes right
after an assistant message's content (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>``
for Gemma), found by rendering a two-turn conversation. A template that cannot render an assistant turn (it raises
on it) has no end-of-turn token of its own: its turns end at the end-of-sequence tokens.

Input: a folder or a transformers tokenizer, messages (a list of ``{"role": str, "content": ...}``). Output: token
ids, stop token ids, text; one PrecastError line for a folder without a template, transformers missing, messages
of the wrong shape, or a template that refuses the conversation (its ``raise_exception`` message).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from precast.errors import PrecastError, first_line
from precast.optional import require

WHAT = "chat"
LLM_EXTRA = "pip install 'precast[llm]'"
# an assistant message's content that templates keep as it is (no spaces to strip, plain ASCII) and that a
# tokenizer does not merge with the token written after it
_SENTINEL = "PrecastEndOfTurnProbe0142857"
Messages = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer with a chat template: ``prompt(messages)`` its token ids, ``stop_tokens`` what ends a turn,
    ``reply(ids)`` the answer's text. ``where`` names the tokenizer in error lines."""

    tokenizer: Any  # a transformers tokenizer (PreTrainedTokenizerBase) whose chat_template is set
    where: str
    end_of_turn: int | None = None
    stop_tokens: list[int] = field(default_factory=list)

    def prompt(self, messages: Messages) -> list[int]:
        """transformers' ``apply_chat_template(messages, add_generation_prompt=True)``: the template rendered,
        then tokenized without the tokenizer's own added special tokens (the template writes them)."""
        check_messages(messages)
        try:
            out = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except _template_errors() as exc:
            raise PrecastError(
                f"{WHAT}: the chat template of {self.where} refused the messages ({first_line(exc)})"
            ) from exc
        return [int(t) for t in out["input_ids"]]

    def reply(self, token_ids: Iterable[int]) -> str:
        """The text of generated ids, special tokens (the end-of-turn token among them) left out."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def chat_template(source: Any, stops: Iterable[int] = ()) -> ChatTemplate:
    """``source`` as a ``ChatTemplate``: a ``ChatTemplate`` (returned as is when ``stops`` adds nothing), a folder
    holding a tokenizer with a chat template (export-llm's), or a transformers tokenizer. ``stops``: more stop
    tokens (export.json's end-of-sequence ids)."""
    message = f"{WHAT}: a chat template needs transformers and jinja2 ({{cause}}): {LLM_EXTRA}"
    require("transformers", "jinja2", message=message, load=False)
    if isinstance(source, ChatTemplate):
        more = sorted(set(source.stop_tokens) | {int(t) for t in stops})
        return source if more == source.stop_tokens else replace(source, stop_tokens=more)
    if isinstance(source, (str, os.PathLike)):
        tokenizer, where = _read_folder(Path(source)), str(source)
    elif callable(getattr(source, "apply_chat_template", None)):
        tokenizer, where = source, f"the tokenizer {type(source).__name__}"
    else:
        raise PrecastError(
            f"{WHAT}: tokenizer={type(source).__name__}; give the folder precast export-llm wrote or a "
            "transformers tokenizer (AutoTokenizer.from_pretrained) with a chat template"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise PrecastError(
            f"{WHAT}: {where} has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja): not a chat model; give a plain prompt instead (--prompt TEXT, or token ids)"
        )
    end = _end_of_turn(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    found = {int(t) for t in stops} | {t for t in (eos, end) if isinstance(t, int)}
    return ChatTemplate(tokenizer, where, end, sorted(found))


def chat_prompt(source: Any, messages: Messages) -> list[int]:
    """The token ids of ``messages`` through the chat template of ``source`` (a folder or a tokenizer), ready
    for the assistant's answer: what transformers' ``apply_chat_template(..., add_generation_prompt=True)``
    gives."""
    return chat_template(source).prompt(messages)


def chat_stop_tokens(source: Any, stops: Iterable[int] = ()) -> list[int]:
    """``stops`` plus the end-of-sequence and end-of-turn tokens of the tokenizer of ``source``, sorted."""
    return chat_template(source, stops).stop_tokens


def chat_inputs(
    input_ids: Any, messages: Messages | None, tokenizer: Any, continue_from: Any
) -> tuple[Any, list[int]]:
    """``precast.generate``'s prompt and the stop tokens its chat adds: ``(input_ids, [])`` without
    ``messages``, else the chat prompt of ``messages`` through ``tokenizer`` and the chat's stop tokens."""
    who = "precast.generate"
    if messages is None:
        if tokenizer is not None:
            raise PrecastError(f"{who}: tokenizer= is for messages=; give messages, or drop tokenizer")
        if input_ids is None:
            raise PrecastError(f"{who}: give input_ids (prompt token ids) or messages= with tokenizer=")
        return input_ids, []
    if input_ids is not None:
        raise PrecastError(f"{who}: give input_ids or messages=, not both")
    if continue_from is not None:
        raise PrecastError(
            f"{who}: messages= starts a conversation; to continue one, pass the whole conversation in messages= "
            "(or token ids with continue_from=)"
        )
    if tokenizer is None:
        raise PrecastError(
            f"{who}: messages= needs tokenizer=: the folder precast export-llm wrote, or a transformers "
            "tokenizer with a chat template"
        )
    chat = chat_template(tokenizer)
    return chat.prompt(messages), chat.stop_tokens


def check_messages(messages: Any) -> None:
    """One line unless ``messages`` is a non-empty list of dicts, each with a string ``role`` and a ``content``."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise PrecastError(
            f"{WHAT}: messages={type(messages).__name__}; give a non-empty list of "
            '{"role": "user", "content": "..."} dicts'
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise PrecastError(
                f'{WHAT}: messages[{i}] = {m!r:.80}; each message is a dict {{"role": str, "content": ...}}'
            )


def _read_folder(folder: Path) -> Any:
    """The transformers tokenizer of ``folder``, local files only; one line when there is none."""
    if not folder.is_dir():
        raise PrecastError(
            f"{WHAT}: {folder} is not a folder; give the folder precast export-llm wrote (its tokenizer files)"
        )
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise PrecastError(
            f"{WHAT}: {folder} holds no tokenizer (tokenizer.json, tokenizer_config.json); give the folder "
            "precast export-llm wrote from a checkpoint or GGUF with a tokenizer"
        )
    from transformers import AutoTokenizer

    from precast.llm.checkpoint import quiet_transformers

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # tokenizers' Rust library raises its own exception type for a malformed file
        raise PrecastError(f"{WHAT}: {folder}: cannot read its tokenizer ({first_line(exc)})") from exc


def _end_of_turn(tokenizer: Any) -> int | None:
    """The special token the template writes right after an assistant message's content, or None (a template
    that raises on an assistant turn, or writes no special token after it)."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except _template_errors():  # the template refuses this conversation: its turns end at end-of-sequence
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        int(i)
        for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(t, "special", False)
    }
    return int(ids[0]) if ids and int(ids[0]) in special else None


def _template_errors() -> tuple[type[Exception], ...]:
    """What rendering a chat template raises for a conversation it refuses: jinja2's TemplateError (its
    ``raise_exception``) and the ValueError / TypeError / KeyError of a template reading a field it lacks."""
    import jinja2

    return (jinja2.TemplateError, ValueError, TypeError, KeyError)
