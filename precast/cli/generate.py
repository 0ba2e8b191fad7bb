"""precast generate IN.pt2|DIR (--prompt-ids 1,2,3 | --prompt TEXT --tokenizer tokenizer.json) --max-new-tokens N
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-tokens 2,3]
                   [--backend aoti|openvino|eager] [--cache-dir DIR] [--weights DIR]

Input: a decoder program saved with torch.export.save (transformers' recipe: ``input_ids``, ``cache_position``, a
static KV cache), converted or not; or the folder ``precast export-llm`` wrote (its program.pt2, its tokenizer.json
unless --tokenizer is given, its end-of-sequence tokens unless --stop-tokens is given). Output: the new tokens on
stdout as they come (ids, comma-separated, or text through the tokenizer), and one line of timings on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from precast.errors import PrecastError
from precast.paths import check_input_file

BACKENDS = ("aoti", "openvino", "eager")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate tokens with a decoder program (transformers' recipe: input_ids, cache_position)",
        description="Generate tokens with a saved decoder program exported with transformers' recipe: compiled "
        "with AOTInductor (cached, default), OpenVINO, or run eagerly. Greedy unless a sampling option is "
        "given. The new tokens go to stdout as they come; timings to stderr.",
    )
    p.add_argument(
        "source",
        help="a program saved with torch.export.save (.pt2), e.g. by 'precast convert', or the folder 'precast "
        "export-llm' wrote (its program, tokenizer and end-of-sequence tokens)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt-ids", metavar="IDS", help="the prompt's token ids, comma-separated: 1,17,42"
    )
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (needs --tokenizer)")
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a tokenizer.json (Hugging Face `tokenizers` format, pip install 'precast[llm]'): encodes --prompt "
        "and decodes the output to text",
    )
    p.add_argument("--max-new-tokens", type=_integer, required=True, metavar="N")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (> 0)")
    p.add_argument("--top-k", type=_integer, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within the top-P probability mass")
    p.add_argument("--seed", type=_integer, default=None, help="seed of the sampling (reproducible draws)")
    p.add_argument("--stop-tokens", metavar="IDS", default=None, help="stop after one of these ids: 2,32000")
    p.add_argument("--backend", choices=BACKENDS, default="aoti", help="default: aoti (AOTInductor, cached)")
    p.add_argument(
        "--cache-dir", default=None, help="aoti only; default: $PRECAST_CACHE_DIR or the user cache dir"
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="DIR",
        help="aoti only: the shards of a program converted with streamed weights",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a .pt2 whose sample inputs or constants need a full unpickle (it can run code: trusted files only)",
    )
    p.set_defaults(run=run)


# token ids as typed: ASCII digits, separated by single commas, spaces around them allowed (int() alone would take
# "1_0", non-ASCII digits, and split on ",," into an empty item)
_IDS = re.compile(r" *[0-9]+ *(?:, *[0-9]+ *)*")


def _integer(text: str) -> int:
    """An argparse type: an integer in ASCII digits, optionally signed (``int`` alone takes "1_0" and other
    scripts' digits)."""
    if not re.fullmatch(r" *-?[0-9]+ *", text):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (ASCII digits)")
    return int(text)


def _ids(text: str, option: str) -> list[int]:
    if not _IDS.fullmatch(text):
        raise PrecastError(
            f"{option} {text!r}: give integer token ids >= 0 (ASCII digits) separated by commas, e.g. 1,17,42"
        )
    return [int(t) for t in text.split(",")]


def _tokenizer(path: str | None):
    if path is None:
        return None
    check_input_file(path, "give a tokenizer.json", "--tokenizer")  # a FIFO or device: refused unopened
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrecastError("--tokenizer needs the tokenizers package: pip install 'precast[llm]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises its own exception type for a malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PrecastError(f"--tokenizer {path}: not a tokenizer.json ({first[:200]})") from exc


def run(args: argparse.Namespace) -> int:
    import precast
    from precast.llm.convention import check_room, check_tokens, convention
    from precast.llm.sampling import sampler
    from precast.pipeline.load import load_program
    from precast.runtime.signature import ProgramSignature

    stops_given = None
    if Path(args.source).is_dir():  # an export-llm folder: its program, tokenizer and stop tokens
        from precast.cli.artifact import artifact_files

        program_file, tokenizer_file, stops_given = artifact_files(Path(args.source))
        args.source = str(program_file)
        if args.tokenizer is None and tokenizer_file is not None:
            args.tokenizer = str(tokenizer_file)
    if args.backend != "aoti" and (args.cache_dir or args.weights):
        option = "--cache-dir" if args.cache_dir else "--weights"
        raise PrecastError(f"{option} applies to --backend aoti only; drop it for --backend {args.backend}")
    if args.max_new_tokens < 1:
        raise PrecastError(f"--max-new-tokens {args.max_new_tokens}: give a number >= 1")
    if args.prompt is not None and args.tokenizer is None:
        raise PrecastError("--prompt is text: give --tokenizer tokenizer.json to encode it, or --prompt-ids")
    tokenizer = _tokenizer(args.tokenizer)
    prompt = (
        _ids(args.prompt_ids, "--prompt-ids")
        if args.prompt_ids is not None
        else tokenizer.encode(args.prompt).ids
    )
    stops = _ids(args.stop_tokens, "--stop-tokens") if args.stop_tokens is not None else stops_given or None
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    sampler(None, generator=None, **sampling)  # a bad sampling option is one line before anything loads
    program = load_program(args.source, trust_pickle=args.trust_pickle)
    # the program's call convention, the prompt in its vocabulary and the cache's room, before a compile of a minute
    conv = convention(ProgramSignature.from_program(program))
    check_tokens(conv, prompt, "--prompt-ids" if args.prompt_ids is not None else "--prompt's ids", who="")
    check_room(conv, 0, len(prompt), args.max_new_tokens)
    if args.backend == "eager":
        model = program
    elif args.backend == "aoti":
        model = precast.compile(program, cache_dir=args.cache_dir, weights=args.weights)
    else:
        model = precast.compile(program, backend="openvino")
    shown: list[int] = []

    def stream(token: int) -> None:
        shown.append(token)
        if tokenizer is None:
            sys.stdout.write(("," if len(shown) > 1 else "") + str(token))
        else:  # decode the whole text each time: a token may complete a character begun by the previous one
            before = tokenizer.decode(shown[:-1])
            sys.stdout.write(tokenizer.decode(shown)[len(before) :])
        sys.stdout.flush()

    res = precast.generate(
        model, prompt, max_new_tokens=args.max_new_tokens, stop_tokens=stops, streamer=stream, **sampling
    )
    sys.stdout.write("\n")
    print(
        f"{len(res.new_tokens)} new tokens ({res.stop_reason}) after a prompt of {res.prompt_length}: prefill "
        f"{res.prefill_seconds * 1e3:.1f} ms, decode {res.tokens_per_second:.1f} tokens/s ({args.backend})",
        file=sys.stderr,
    )
    return 0
