"""The README's LLM section and docs/streaming.md's three steps, run as written: every ```python block of those
sections, extracted from the files and executed in order in one namespace (a fresh folder as the working
directory, the session's AOTInductor cache). The only substitution: streaming.md's ``"path/to/model"`` becomes a
folder holding a small Llama saved with ``save_pretrained`` (its config.json and safetensors). So a snippet that
stops working with the pinned transformers (5.23: "Found DynamicCache in output") or names something undefined
fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path, start: str, stop: str = r"^## ") -> list[str]:
    """The ```python blocks of ``path`` between the heading matching ``start`` and the next matching ``stop``."""
    text = path.read_text()
    head = re.search(start, text, re.M)
    assert head, f"{path}: no heading {start!r}"
    end = re.compile(stop, re.M).search(text, head.end())
    section = text[head.end() : end.start() if end else len(text)]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert blocks, f"{path}: no python block under {start!r}"
    return blocks


def run_blocks(blocks: list[str], where: str) -> dict:
    namespace: dict = {"__name__": "__doc__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{where} block {i + 1}", "exec"), namespace)  # noqa: S102 - the repository's docs
    return namespace


@pytest.mark.aoti
def test_readme_llm_section_runs_as_written(tmp_path, monkeypatch, aoti_cache):
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(aoti_cache))
    ns = run_blocks(python_blocks(ROOT / "README.md", r"^## LLMs"), "README.md ## LLMs")
    out = ns["out"]
    # the last generation: the program itself, greedy; the compiled model's greedy run gave the same tokens
    assert len(out.new_tokens) == 20 and out.tokens.shape == (1, 24)
    assert ns["res"].report.cache["dtype"] == "bf16"
    greedy = ns["precast"].generate(ns["decoder"], ns["ids"], max_new_tokens=20).new_tokens
    assert greedy == ns["precast"].generate(ns["res"].program, ns["ids"], max_new_tokens=20).new_tokens
    assert isinstance(ns["ep"], torch.export.ExportedProgram)


@pytest.mark.aoti
def test_streaming_steps_run_as_written(tmp_path, monkeypatch, aoti_cache):
    import torch
    import transformers

    folder = tmp_path / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(aoti_cache))
    blocks = [
        b.replace('"path/to/model"', repr(str(folder)))
        for b in python_blocks(ROOT / "docs" / "streaming.md", r"^## 1\. ", r"^## Figures")
    ]
    ns = run_blocks(blocks, "docs/streaming.md")
    # the streamed conversion (policy torch, bf16) runs: eagerly from its shards, and compiled
    with torch.no_grad():
        want = model(input_ids=ns["ids"], use_cache=False).logits
    logits = ns["logits"]
    assert logits.shape == want.shape and torch.isfinite(logits).all()
    cos = torch.nn.functional.cosine_similarity(logits.float().flatten(), want.flatten(), dim=0)
    assert cos > 0.99, cos  # bf16 weights and compute against the fp32 model
    torch.testing.assert_close(ns["compiled"](ns["ids"]).float(), logits.float(), rtol=2e-2, atol=2e-2)
    assert (work / "model.pt2").is_file() and (work / "converted.weights").is_dir()
