"""precast generate IN.pt2|DIR (--prompt-ids 1,2,3 | --prompt TEXT --tokenizer tokenizer.json | --chat TEXT)
                   --max-new-tokens N
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-tokens 2,3]
                   [--backend aoti|openvino|eager] [--cache-dir DIR] [--weights DIR]
                   (--backend: the engines of ``precast.backends.registry`` that run a KV cache, or eager)

Input: a decoder program saved with torch.export.save (transformers' recipe: ``input_ids``, ``cache_position``, a
static KV cache), converted or not; or the folder ``precast export-llm`` wrote (its program.pt2, its tokenizer.json
unless --tokenizer is given, its end-of-sequence tokens unless --stop-tokens is given). ``--chat TEXT``: a user
message through the chat template of the tokenizer's folder (``llm/chat.py``); its end-of-turn token stops too, and
the stop tokens are not printed. Output: the new tokens on stdout as they come (ids, comma-separated, or text
through the tokenizer), and one line of timings on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precast.backends.registry import ENGINES, engine, stateful_names
from precast.cli.flags import CACHE_DIR, THREADS, TRUST_PICKLE, Group, add_command, flag
from precast.errors import PrecastError

BACKENDS = (*stateful_names(), "eager")  # an engine that carries a decoder's KV cache, or torch eagerly
# the engine options flags set, by flag: refused (one line) for an engine whose compile takes no such option
_ENGINE_FLAGS = {"--cache-dir": "cache_dir", "--weights": "weights"}


# token ids as typed: ASCII digits, separated by single commas, spaces around them allowed (int() alone would take
# "1_0", non-ASCII digits, and split on ",," into an empty item)
_IDS = re.compile(r" *[0-9]+ *(?:, *[0-9]+ *)*")


def _integer(text: str) -> int:
    """An argparse type: an integer in ASCII digits, optionally signed (``int`` alone takes "1_0" and other
    scripts' digits)."""
    if not re.fullmatch(r" *-?[0-9]+ *", text):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (ASCII digits)")
    return int(text)


PROMPT = Group(exclusive=True, required=True)

ARGUMENTS = (
    flag(
        "source",
        help="a program saved with torch.export.save (.pt2), e.g. by 'precast convert', or the folder 'precast "
        "export-llm' wrote (its program, tokenizer and end-of-sequence tokens)",
    ),
    flag(
        "--prompt-ids", group=PROMPT, metavar="IDS", help="the prompt's token ids, comma-separated: 1,17,42"
    ),
    flag("--prompt", group=PROMPT, metavar="TEXT", help="the prompt as text (needs --tokenizer)"),
    flag(
        "--chat",
        group=PROMPT,
        metavar="TEXT",
        help="a user message through the chat template of the folder's tokenizer (an Instruct model's prompt); "
        "the template's end-of-turn token stops too, unless --stop-tokens is given",
    ),
    flag(
        "--tokenizer",
        metavar="FILE",
        help="a tokenizer.json (Hugging Face `tokenizers` format, pip install 'precast[llm]'): encodes --prompt "
        "and decodes the output to text",
    ),
    flag("--max-new-tokens", type=_integer, required=True, metavar="N"),
    flag("--temperature", type=float, default=None, help="sample at this temperature (> 0)"),
    flag("--top-k", type=_integer, default=None, help="sample among the K most likely tokens"),
    flag("--top-p", type=float, default=None, help="sample within the top-P probability mass"),
    flag("--seed", type=_integer, default=None, help="seed of the sampling (reproducible draws)"),
    flag("--stop-tokens", metavar="IDS", default=None, help="stop after one of these ids: 2,32000"),
    flag(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="default: for a folder, the engine it holds (its OpenVINO IR, else its AOTInductor package), run "
        "without converting; for a program, aoti (AOTInductor, cached)",
    ),
    THREADS,
    CACHE_DIR,
    flag(
        "--weights",
        default=None,
        metavar="DIR",
        help="aoti only: the shards of a program converted with streamed weights",
    ),
    TRUST_PICKLE,
)


def add_parser(sub: Any) -> None:
    """``precast generate``: the flags of ``ARGUMENTS``, run by ``run``."""
    add_command(
        sub,
        "generate",
        ARGUMENTS,
        run=run,
        help="generate tokens with a decoder program (transformers' recipe: input_ids, cache_position)",
        description="Generate tokens with a saved decoder program exported with transformers' recipe: compiled "
        "with AOTInductor (cached, default), OpenVINO, or run eagerly. Greedy unless a sampling option is "
        "given. The new tokens go to stdout as they come; timings to stderr.",
    )


def _ids(text: str, option: str) -> list[int]:
    if not _IDS.fullmatch(text):
        raise PrecastError(
            f"{option} {text!r}: give integer token ids >= 0 (ASCII digits) separated by commas, e.g. 1,17,42"
        )
    return [int(t) for t in text.split(",")]


def _tokenizer(path: str | None) -> Any:
    from precast.llm.folder import read_tokenizer

    return None if path is None else read_tokenizer(path, "--tokenizer")


def run(args: argparse.Namespace) -> int:
    """Every option checked, the program loaded and compiled, the new tokens streamed, the timings printed."""
    import precast
    from precast.pipeline.load import load_program

    folder = _read_folder(args)
    stops_given = folder.stop_tokens if folder is not None else None
    _check_flags(args)
    tokenizer = _tokenizer(args.tokenizer)
    chat = _chat(args, stops_given)
    prompt = _prompt(args, tokenizer, chat)
    given = stops_given if chat is None else chat.stop_tokens
    stops = _ids(args.stop_tokens, "--stop-tokens") if args.stop_tokens is not None else given or None
    sampling = _sampling(args)
    if folder is None:
        program = load_program(args.source, trust_pickle=args.trust_pickle)
        _check_program(args, program, prompt)
        model, threads = _model(args, program)
    else:
        model, threads = _folder_model(args, folder, prompt)
    res = precast.generate(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        stop_tokens=stops,
        streamer=_streamer(tokenizer, hide=stops if chat is not None else ()),
        **sampling,
    )
    sys.stdout.write("\n")
    print(
        f"{len(res.new_tokens)} new tokens ({res.stop_reason}) after a prompt of {res.prompt_length}: prefill "
        f"{res.prefill_seconds * 1e3:.1f} ms, decode {res.tokens_per_second:.1f} tokens/s ({args.backend}"
        + (f", {threads} thread{'s' if threads != 1 else ''})" if threads else ")"),
        file=sys.stderr,
    )
    return 0


def _read_folder(args: argparse.Namespace) -> Any:
    """An export-llm folder as SOURCE, read (``precast.llm.folder.Folder``: its tokenizer into ``args`` unless
    --tokenizer; its backend, unless --backend, the engine it holds); None for a program file."""
    if not Path(args.source).is_dir():
        args.backend = args.backend or "aoti"
        return None
    from precast.llm.folder import open_folder
    from precast.llm.folder_engines import default_backend

    folder = open_folder(args.source)
    if args.tokenizer is None and folder.tokenizer is not None:
        args.tokenizer = str(folder.tokenizer)
    args.backend = args.backend or default_backend(folder)
    if args.weights:
        raise PrecastError("--weights is for a program file; a folder holds its weights")
    return folder


def _folder_model(args: argparse.Namespace, folder: Any, prompt: list[int]) -> tuple[Any, int | None]:
    """The folder's engine as it holds it (``precast.llm.folder_engines``: opened, or rebuilt where not valid
    here, each said in one line on stderr), the prompt checked against its signature before the first call."""
    from precast.llm.folder_engines import load_engine

    model, notes, threads = load_engine(
        folder, args.backend, args.threads, args.cache_dir, args.trust_pickle, notify=_tell
    )
    for note in notes:
        print(note, file=sys.stderr)
    _check_program(args, model, prompt)
    return model, threads


def _tell(line: str) -> None:
    """A rebuild about to start, said before it (stderr, flushed: a log shows it while the wait runs)."""
    print(line, file=sys.stderr, flush=True)


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that need each other, checked before anything is read."""
    takes = () if args.backend in ("eager", None) else engine(args.backend, "--backend").options
    for name, option in _ENGINE_FLAGS.items():
        if getattr(args, option) and option not in takes:
            takers = " / ".join(e.name for e in ENGINES if option in e.options)
            raise PrecastError(
                f"{name} applies to --backend {takers} only; drop it for --backend {args.backend}"
            )
    if args.max_new_tokens < 1:
        raise PrecastError(f"--max-new-tokens {args.max_new_tokens}: give a number >= 1")
    if args.prompt is not None and args.tokenizer is None:
        raise PrecastError("--prompt is text: give --tokenizer tokenizer.json to encode it, or --prompt-ids")
    if args.chat is not None and args.tokenizer is None:
        raise PrecastError(
            "--chat needs a chat template: give the folder precast export-llm wrote, or --tokenizer "
            "DIR/tokenizer.json beside its tokenizer_config.json / chat_template.jinja"
        )


def _prompt(args: argparse.Namespace, tokenizer: Any, chat: Any = None) -> list[int]:
    """The prompt's token ids: --prompt-ids as typed, --prompt through the tokenizer, or --chat's message
    through the chat template."""
    if chat is not None:
        return chat.prompt([{"role": "user", "content": args.chat}])
    if args.prompt_ids is not None:
        return _ids(args.prompt_ids, "--prompt-ids")
    return tokenizer.encode(args.prompt).ids


def _chat(args: argparse.Namespace, stops_given: list[int] | None) -> Any:
    """--chat's template (``llm/chat.py``): read from the tokenizer's folder (export-llm's), its stop tokens the
    folder's end-of-sequence ids plus the template's end-of-turn token; None without --chat."""
    if args.chat is None:
        return None
    from precast.llm.chat import chat_template

    return chat_template(Path(args.tokenizer).parent, stops_given or ())


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options, checked now: a bad one is one line before anything loads."""
    from precast.llm.sampling import sampler

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    sampler(None, generator=None, **sampling)
    return sampling


def _check_program(args: argparse.Namespace, program: Any, prompt: list[int]) -> None:
    """The program's call convention, the prompt in its vocabulary and the cache's room, before a compile of a
    minute."""
    from precast.llm.convention import check_room, check_tokens, convention
    from precast.runtime.signature import ProgramSignature

    signature = getattr(program, "signature", None)  # a compiled model's, else the program's own
    conv = convention(signature if signature is not None else ProgramSignature.from_program(program))
    check_tokens(conv, prompt, "--prompt-ids" if args.prompt_ids is not None else "--prompt's ids", who="")
    check_room(conv, 0, len(prompt), args.max_new_tokens)


def _model(args: argparse.Namespace, program: Any) -> tuple[Any, int | None]:
    """The program as --backend runs it: eagerly, or compiled by that engine (``precast.compile``: AOTInductor
    cached, OpenVINO, ...); and the thread count the engine runs at."""
    import precast
    from precast.runtime.threads import resolve_threads

    if args.backend == "eager":
        return program, None
    threads = resolve_threads(args.threads, "--threads")
    options = {option: getattr(args, option) for option in _ENGINE_FLAGS.values() if getattr(args, option)}
    return precast.compile(program, backend=args.backend, threads=threads, **options), threads


def _streamer(tokenizer: Any, hide: Any = ()) -> Callable[[int], None]:
    """Writes each new token to stdout as it comes: its id (comma-separated), or its text; ``hide``: tokens not
    written (--chat's end-of-turn and end-of-sequence tokens)."""
    shown: list[int] = []

    def stream(token: int) -> None:
        if token in hide:
            return
        shown.append(token)
        if tokenizer is None:
            sys.stdout.write(("," if len(shown) > 1 else "") + str(token))
        else:  # decode the whole text each time: a token may complete a character begun by the previous one
            before = tokenizer.decode(shown[:-1])
            sys.stdout.write(tokenizer.decode(shown)[len(before) :])
        sys.stdout.flush()

    return stream
