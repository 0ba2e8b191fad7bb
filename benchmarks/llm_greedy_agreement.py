"""Greedy text from LLM folders against a reference folder (issue 50: "greedy generation at 4.6 bits on the README's
prompts stays coherent; state the token agreement with bf16"): each folder's program run eagerly
(``precast.load(DIR, backend="eager")``), greedy, on the README's prompts and its chat question.

    PYTHONPATH=. python -m benchmarks.llm_greedy_agreement REFERENCE_DIR DIR [DIR ...] [--max-new-tokens 40]
        [--out FILE.json]

Per prompt and folder: the first new token that differs from the reference's (greedy decoding never re-syncs
after it, so the tokens after the first difference say nothing about agreement), the tokens equal position by
position, and both texts. Teacher-forced top-1 agreement on held-out text is export-llm's own ``accuracy`` line;
this is what a reader of the generated text sees. Figures, not tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# the README's prompts (its LLM section) and the issue's, then its chat question
PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):")
CHAT = ("What is the capital of France?",)


def generations(folder: str, max_new_tokens: int) -> dict[str, tuple[list[int], str]]:
    """Prompt -> (the new token ids, their text) from ``folder``'s program, greedy."""
    import precast

    llm = precast.load(folder, backend="eager")
    out: dict[str, tuple[list[int], str]] = {}
    for prompt in PROMPTS:
        r = llm.generate(prompt, max_new_tokens=max_new_tokens)
        out[prompt] = ([int(t) for t in r.new_tokens], llm.decode(r.new_tokens))
    for question in CHAT:
        r = llm.generate(messages=[{"role": "user", "content": question}], max_new_tokens=max_new_tokens)
        out[question] = ([int(t) for t in r.new_tokens], llm.decode(r.new_tokens))
    return out


def agreement(ref: list[int], got: list[int]) -> dict[str, Any]:
    """Where ``got`` first differs from ``ref`` (its length where it is a prefix of the other), and the positions
    equal out of the longer's length."""
    first = next(
        (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
    )
    if len(ref) == len(got) == first:
        first = None  # the same tokens throughout
    return {
        "first_difference": first,
        "equal": sum(a == b for a, b in zip(ref, got, strict=False)),
        "of": max(len(ref), len(got)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llm_greedy_agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="the reference folder (precast export-llm's, e.g. bf16)")
    ap.add_argument("folders", nargs="+", help="the folders to compare with it")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    reference = generations(args.reference, args.max_new_tokens)
    rows = []
    for folder in args.folders:
        got = generations(folder, args.max_new_tokens)
        for prompt, (ref_ids, ref_text) in reference.items():
            ids, text = got[prompt]
            rows.append(
                {
                    "folder": folder,
                    "prompt": prompt,
                    **agreement(ref_ids, ids),
                    "reference": ref_text,
                    "text": text,
                }
            )
    print("| folder | prompt | first new token that differs | equal positions | text |")
    print("|---|---|---|---|---|")
    for r in rows:
        first = "none" if r["first_difference"] is None else str(r["first_difference"] + 1)
        text = json.dumps(r["text"], ensure_ascii=False)[:120]
        print(f"| {Path(r['folder']).name} | {r['prompt']} | {first} | {r['equal']}/{r['of']} | {text} |")
    for prompt, (_, text) in reference.items():
        print(f"reference, {prompt!r}: {json.dumps(text, ensure_ascii=False)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"reference": args.reference, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
