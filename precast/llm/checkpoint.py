"""A transformers checkpoint read as an fp32 decoder, exported with transformers' static-cache recipe, and text
cut into calibration windows: what ``precast export-llm`` runs before it converts.

- ``locate(model, gguf)``: the checkpoint's files (a ``save_pretrained`` folder: config.json + safetensors; or a
  GGUF file, given itself or as ``gguf=`` inside / beside the folder), checked before anything loads; a model
  that is not a decoder-only causal LM is refused from its config.json, before its weights are read.
- ``read(source)``: the model in fp32 (eval) and its tokenizer (None when the checkpoint has none).
- ``export_decoder(model, max_cache_len)``: ``TorchExportableModuleForDecoderOnlyLM``'s strict export, the
  sequence dimension dynamic (1 .. max_cache_len - 1: a prompt is one call), the cache held in buffers.
- ``read_text(path)``, ``calibration_windows(tokenizer, text, window, tokens)``: the text's first ``tokens`` tokens in windows of
  ``window``, each a batch ``{"input_ids", "cache_position"}`` from an empty cache (``precast.WeightBudget``'s data).
- ``stop_ids(model)``: the end-of-sequence ids the checkpoint's generation config names.

Nothing is downloaded: transformers reads local files only (``local_files_only=True``).

Input: paths, a model, text. Output: a ``Checkpoint``, an ``ExportedProgram``, batches; a one-line PrecastError
for every bad input.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from precast.errors import PrecastError, first_line
from precast.optional import require
from precast.paths import check_input_file
from precast.progress import verbose

LLM_EXTRA = "pip install 'precast[llm]'"
GGUF_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read (and dequantize) a GGUF file
GGUF_EXTRA = "pip install 'precast[gguf]' (gguf, accelerate)"
MIN_CACHE = 8
EXAMPLE_LENGTH = 4  # the example prompt the export traces with (the sequence dimension is dynamic)
# the tokenizer's own files copied from a checkpoint folder as they are (tokenizer.json is what precast reads)
SLOW_FILES = (
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)  # a tokenizer transformers may convert to tokenizer.json
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass
class Source:
    """Where a checkpoint is: ``folder`` (what transformers is given) and ``gguf`` (a file in it, or None)."""

    folder: Path
    gguf: Path | None = None
    config: Any = None  # a folder's config (read by ``locate``); a GGUF's comes with its weights
    files: list[Path] = field(default_factory=list)  # every file read: none of them may be written

    @property
    def name(self) -> str:
        return str(self.gguf if self.gguf is not None else self.folder)


@dataclass
class Checkpoint:
    model: torch.nn.Module | None  # None once freed (after the conversion)
    tokenizer: Any  # a transformers tokenizer, or None
    source: Source
    tokenizer_note: str = ""  # why there is no tokenizer

    def about(self) -> dict[str, Any]:
        """The model's class, parameter count and end-of-sequence ids (kept after the model is freed)."""
        return {
            "architecture": type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "stop_tokens": stop_ids(self.model),
        }


def require_transformers() -> None:
    """transformers and tokenizers found (not imported: slow), or a one-line PrecastError naming the extra."""
    message = f"reading a transformers checkpoint needs transformers and tokenizers: {LLM_EXTRA}"
    require("transformers", "tokenizers", message=message, load=False)


def locate(model: str, gguf: str | None = None, gguf_said: str = "--gguf") -> Source:
    """The checkpoint's files, checked (one line each); for a folder, its config read and checked a decoder.
    ``gguf_said``: how a refusal names the GGUF option (``--gguf`` on the command line, ``gguf=`` in Python)."""
    p = Path(model)
    if not p.exists():
        raise PrecastError(
            f"{p}: no such folder; give a folder save_pretrained wrote (config.json + safetensors) or a .gguf"
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf" or gguf is not None:
            raise PrecastError(
                f"{p}: is a file; give the model's folder (config.json + safetensors), or a .gguf file alone"
            )
        gguf, p = p.name, p.parent
    if gguf is not None:
        found = _gguf_file(p, gguf, gguf_said)
        return Source(p, found, files=[found])
    config = check_input_file(
        p / "config.json",
        f"give a folder save_pretrained wrote (config.json + safetensors), or {gguf_said} FILE",
    )
    shards = sorted(p.glob("*.safetensors"))
    if not shards:
        raise PrecastError(
            f"{p}: no .safetensors weights in it (only safetensors are read: a .bin is a pickle); save the model "
            f"with save_pretrained, or give {gguf_said} FILE"
        )
    require_transformers()
    source = Source(p, None, _config(p), [config, *shards, *sorted(p.glob("*.safetensors.index.json"))])
    source.files += [p / f for f in TOKENIZER_FILES if (p / f).is_file()]
    check_decoder(source.config, str(p))
    return source


def _gguf_file(folder: Path, name: str, said: str = "--gguf") -> Path:
    """``--gguf FILE``: the path as given, else inside the folder; the packages transformers needs checked."""
    given = Path(name)
    path = given if given.is_absolute() or given.exists() else folder / given
    check_input_file(path, "give the .gguf file inside or beside the model folder", said)
    require_transformers()
    missing = [m for m in GGUF_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise PrecastError(
            f"{said} {name}: transformers reads a GGUF file with the {' and '.join(GGUF_PACKAGES)} packages "
            f"({', '.join(missing)} missing): {GGUF_EXTRA}"
        )
    return path.resolve()


def _config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # an unknown model_type, malformed JSON: transformers' own words, one line
        raise PrecastError(
            f"{folder / 'config.json'}: transformers cannot read it ({first_line(exc)})"
        ) from exc


def check_decoder(config: Any, where: str) -> None:
    """A decoder-only causal LM that the export recipe takes, judged from the config (one line when not)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", "?")
    archs = list(getattr(config, "architectures", None) or [])
    named = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    names = {named} if isinstance(named, str) else set(named or ())
    causal = [a for a in archs if a in names or a.endswith(("ForCausalLM", "LMHeadModel"))]
    if named is None or getattr(config, "is_encoder_decoder", False) or (archs and not causal):
        what = f"{kind} model" + (f" ({', '.join(archs)})" if archs else "")
        raise PrecastError(
            f"{where}: a {what} is not a decoder-only causal LM; export-llm exports decoders such as Llama, "
            "Qwen, Mistral, Phi, Gemma, SmolLM (precast convert takes any other exported program)"
        )


# ``precast --verbose``: the command sets it for its run (``PRECAST_VERBOSE=1`` works without it)
SHOW_LIBRARIES: contextvars.ContextVar[bool] = contextvars.ContextVar("show_libraries", default=False)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and info/warning logs held back for the block, unless ``PRECAST_VERBOSE=1``
    (``precast.progress.verbose``) or ``precast --verbose`` (``SHOW_LIBRARIES``); restored after."""
    if verbose() or SHOW_LIBRARIES.get():
        yield
        return
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")  # a raw tqdm, not transformers' switch
    bar = getattr(gguf, "tqdm", None)
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)  # type: ignore[union-attr]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if bar is not None:
            gguf.tqdm = bar  # type: ignore[union-attr]


def read(source: Source) -> Checkpoint:
    """The model in fp32 (eval) and its tokenizer, read from local files only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"gguf_file": source.gguf.name} if source.gguf is not None else {"use_safetensors": True}
    if source.gguf is not None:  # imported now, so that quiet_transformers holds its progress bar back
        importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    folder = source.gguf.parent if source.gguf is not None else source.folder
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, local_files_only=True, **where
            ).eval()
    except PrecastError:
        raise
    except Exception as exc:
        raise PrecastError(
            f"{source.name}: transformers could not read the model ({first_line(exc)})"
        ) from exc
    if source.gguf is not None:
        check_decoder(model.config, source.name)
    tokenizer, note = None, ""
    try:
        if not has_tokenizer(source):
            raise FileNotFoundError(f"no tokenizer files in {folder}")
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(
                folder, local_files_only=True, **_tokenizer_where(where)
            )
    except Exception as exc:  # no tokenizer: the artifact has none (generate with token ids)
        note = first_line(exc).rstrip(":")
    if tokenizer is not None and getattr(tokenizer, "backend_tokenizer", None) is None:
        tokenizer, note = (
            None,
            f"{type(tokenizer).__name__} has no tokenizer.json form (not a fast tokenizer)",
        )
    return Checkpoint(model, tokenizer, source, note)


def has_tokenizer(source: Source) -> bool:
    """Whether the checkpoint has tokenizer files (a GGUF carries its vocabulary)."""
    files = (*TOKENIZER_FILES, *SLOW_FILES)
    return source.gguf is not None or any((source.folder / f).is_file() for f in files)


def _tokenizer_where(where: dict) -> dict:
    return {k: v for k, v in where.items() if k == "gguf_file"}


def max_positions(model_or_config: Any) -> int | None:
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def check_cache_len(max_cache_len: int, model_or_config: Any, said: str | None = None) -> None:
    """``said``: how a refusal names the option and its value (default ``--max-cache-len N``)."""
    said = said or f"--max-cache-len {max_cache_len}"
    if max_cache_len < MIN_CACHE:
        raise PrecastError(f"{said}: give at least {MIN_CACHE} positions")
    limit = max_positions(model_or_config)
    if limit is not None and max_cache_len > limit:
        raise PrecastError(
            f"{said}: the model's config allows {limit} positions "
            "(max_position_embeddings); give at most that"
        )


def export_decoder(model: torch.nn.Module, max_cache_len: int) -> torch.export.ExportedProgram:
    """transformers' static-cache recipe (``TorchExportableModuleForDecoderOnlyLM``), strict, batch 1, the
    sequence dimension dynamic up to ``max_cache_len - 1``; the caller's model is set up for a static cache."""
    from torch.export import Dim
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        **{**_generation_ids(model), "use_cache": True, "cache_implementation": "static"},
        max_length=max_cache_len,
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    seq = Dim("seq", min=1, max=max_cache_len - 1)
    ids = torch.zeros(1, EXAMPLE_LENGTH, dtype=torch.long)
    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
            return wrapper.export(
                input_ids=ids,
                cache_position=torch.arange(EXAMPLE_LENGTH),
                dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
            )
    except Exception as exc:
        raise PrecastError(
            f"transformers' static-cache export recipe failed on this model ({type(model).__name__}): "
            f"{first_line(exc)}"
        ) from exc


def _generation_ids(model: torch.nn.Module) -> dict[str, Any]:
    """The special token ids of the model's own generation config, kept when the recipe's replaces it."""
    given = getattr(model, "generation_config", None)
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: getattr(given, k) for k in keys if getattr(given, k, None) is not None}


def stop_ids(model: torch.nn.Module) -> list[int]:
    """The end-of-sequence ids of the model's generation config (else its config): what generation stops at."""
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(holder, "eos_token_id", None)
        if eos is None:
            continue
        values = [eos] if isinstance(eos, int) else list(eos)
        return [int(v) for v in values if isinstance(v, int) and v >= 0]
    return []


def read_text(path: str, where: str = "--calibration-text") -> str:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PrecastError(f"{where} {path}: not UTF-8 text (byte {exc.start}); give plain text") from None


def calibration_windows(
    tokenizer: Any,
    text: str,
    window: int,
    tokens: int,
    where: str = "--calibration-text",
    window_said: str = "--calibration-window",
) -> list[dict[str, torch.Tensor]]:
    """The text's first ``tokens`` tokens (the model's own tokenizer) in whole windows of ``window`` tokens, each
    a batch from position 0 of an empty cache; one line when the text holds less than one window."""
    if not text.strip():
        raise PrecastError(f"{where}: the file holds no text")
    with quiet_transformers():
        ids = tokenizer(text)["input_ids"]
    count = min(len(ids), tokens) // window
    if count < 1:
        raise PrecastError(
            f"{where}: {len(ids)} token(s), fewer than one window of {window} ({window_said}); give more "
            "text or a smaller window"
        )
    flat = torch.tensor(ids[: count * window], dtype=torch.long)
    return [
        {"input_ids": flat[i * window : (i + 1) * window][None], "cache_position": torch.arange(window)}
        for i in range(count)
    ]
