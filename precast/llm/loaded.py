"""``precast.load(DIR)``: the folder ``precast export-llm`` wrote, as a ready model, with nothing converted.

    llm = precast.load("smol-int8")              # OpenVINO's form if the folder holds it, else its AOTInductor package
    res = llm.generate("The capital of France is", max_new_tokens=20)
    res = llm.generate(messages=[{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=30)
    print(llm.decode(res.new_tokens)); llm.notes  # what was loaded, and anything rebuilt (and why)

The folder's format, what is valid where and what is rebuilt: ``precast.llm.folder`` and ``folder_engines``.
``precast.load(FILE)`` of a file is the engine registry's (``backends/registry.load``): the compiled model an
artifact ``precast.save`` wrote holds (any engine's), by the record beside it.

Input: a folder path, options. Output: an ``LLM`` (the compiled model, tokenizer, chat template, stop tokens, notes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from precast.errors import PrecastError
from precast.llm.folder import BACKENDS, Folder, open_folder, read_tokenizer


class LLM:
    """A folder's model, loaded: call ``generate`` (text or ids), ``decode``; ``model`` is the compiled model
    (``precast.generate`` takes it too), ``backend`` the engine, ``threads`` its thread count, ``notes`` what was
    loaded and what was rebuilt (and why), ``load_seconds`` the time from the call to a ready model."""

    def __init__(
        self, folder: Folder, model: Any, backend: str, tokenizer: Any, notes: list[str], **facts: Any
    ):
        self.folder = folder
        self.model = model
        self.backend = backend
        self.tokenizer = tokenizer
        self.stop_tokens = list(folder.stop_tokens)
        self.notes = notes
        self.threads: int | None = facts.get("threads")
        self.load_seconds: float = facts.get("load_seconds", 0.0)
        self._chat: Any = None

    def __repr__(self) -> str:
        return f"LLM({self.folder.path}, backend={self.backend!r}, threads={self.threads})"

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise PrecastError(f"{self.folder.path}: the folder has no tokenizer; give token ids")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise PrecastError(f"{self.folder.path}: the folder has no tokenizer; read the ids as they are")
        return self.tokenizer.decode(list(ids))

    def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        max_new_tokens: int,
        messages: list[dict[str, Any]] | None = None,
        **options: Any,
    ) -> Any:
        """``precast.generate`` on the folder's model: ``prompt`` as text (the folder's tokenizer) or token ids,
        or ``messages=`` (a chat through the folder's chat template, which adds its end-of-turn token to the stop
        tokens: ``llm/chat.py``); the folder's stop tokens unless ``stop_tokens=`` is given; other options as
        ``precast.generate``'s."""
        from precast.llm.generate import generate

        options.setdefault("stop_tokens", self.stop_tokens or None)
        if messages is not None:
            if prompt is not None:
                raise PrecastError("LLM.generate: give a prompt or messages=, not both")
            return generate(
                self.model, messages=messages, tokenizer=self.chat(), max_new_tokens=max_new_tokens, **options
            )
        if prompt is None:
            raise PrecastError("LLM.generate: give a prompt (text or token ids) or messages=")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return generate(self.model, ids, max_new_tokens=max_new_tokens, **options)

    def chat(self) -> Any:
        """The folder's chat template (``llm/chat.py``'s ``ChatTemplate``: its prompt and stop tokens), read once;
        one line when the folder has none."""
        if self._chat is None:
            from precast.llm.chat import chat_template

            self._chat = chat_template(self.folder.path, self.stop_tokens)
        return self._chat

    def reset(self) -> None:
        self.model.reset()


def load(
    path: str | Path,
    *,
    backend: str | None = None,
    threads: int | None = None,
    cache_dir: str | Path | None = None,
    trust_pickle: bool = False,
) -> LLM | Any:
    """``precast.load(DIR)``: the folder ``precast export-llm`` wrote, ready to generate (see the module docstring).
    ``precast.load(FILE)``: an artifact ``precast.save`` wrote (any engine's: ``backends/registry.load``, which
    reads the record beside it), the compiled model itself; ``backend`` and ``threads`` as below.

    ``backend``: ``"openvino"`` (the folder's IR), ``"aoti"`` (its AOTInductor package) or ``"eager"`` (the program
    in torch); default: the engine the folder holds (OpenVINO first), else AOTInductor, compiled once into the
    user's cache. ``threads``: the engine's intra-op thread count (default: ``precast.runtime.threads``'s choice).
    ``cache_dir``: where AOTInductor compiles what the folder does not hold. ``trust_pickle``: as ``load_program``'s.
    """
    from precast.llm.folder_engines import default_backend, load_engine

    if Path(path).is_file():
        return _artifact(path, backend, threads, cache_dir, trust_pickle)
    started = time.perf_counter()
    folder = open_folder(path)
    if backend is not None and backend not in BACKENDS:
        raise PrecastError(f"precast.load: backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    chosen = backend or default_backend(folder)
    model, notes, used = load_engine(folder, chosen, threads, cache_dir, trust_pickle)
    tokenizer = _tokenizer(folder.tokenizer, notes)
    return LLM(
        folder, model, chosen, tokenizer, notes, threads=used, load_seconds=time.perf_counter() - started
    )


def _tokenizer(path: Path | None, notes: list[str]) -> Any:
    tokenizer = None if path is None else read_tokenizer(path, "the folder's", required=False)
    if path is not None and tokenizer is None:
        notes.append(
            f"{path.name} not read (no tokenizers package: pip install 'precast[llm]'): token ids only"
        )
    return tokenizer


def _artifact(path: str | Path, backend: str | None, threads: int | None, cache_dir: Any, trust: bool) -> Any:
    """A saved artifact (a file): the engine registry's load; the folder-only options refused in one line."""
    from precast.backends.registry import load as load_artifact

    if cache_dir is not None or trust:
        option = "cache_dir=" if cache_dir is not None else "trust_pickle="
        raise PrecastError(
            f"precast.load: {option} is for an LLM folder; {path} is a saved artifact: drop it"
        )
    return load_artifact(path, backend=backend, threads=threads)
