"""The decode harness's anchor (``precast.bench.decode``): OpenVINO's own export of the same saved weights
(optimum-intel) in another Python environment (optimum-intel 2.2 needs transformers < 5.6), one persistent
process per thread count, so its samples interleave with the in-process forms' repeat by repeat.

- ``ANCHOR_ENV``, ``anchor_python``, ``anchor_env_commands``: where the anchor's environment lives, its Python,
  the commands that build it (``precast bench --llm --build-anchor-env``).
- ``AnchorProcess``: one persistent process of ``ov_anchor.py`` at one thread count, sampled as (prefill ms,
  ms per decoded token).
- ``save_for_anchor``: the seeded fp32 model saved with ``save_pretrained`` (the anchor exports these weights).

Input: the anchor's Python, a saved model, a shape, a thread count. Output: samples, export seconds, RSS.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import platformdirs
import torch

from precast.bench.decode_model import Shape

# where `precast bench --llm --build-anchor-env` builds the anchor's environment (optimum-intel pins transformers
# < 5.6); $PRECAST_OV_ANCHOR_PYTHON or --anchor-python point elsewhere
ANCHOR_ENV = str(Path(platformdirs.user_data_dir("precast")) / "ov-anchor")
ANCHOR_SCRIPT = Path(__file__).with_name("ov_anchor.py")


def anchor_python(explicit: str | None = None) -> str | None:
    """The Python of the anchor's environment: ``explicit``, ``$PRECAST_OV_ANCHOR_PYTHON``, or ``ANCHOR_ENV``'s;
    None where none exists."""
    for cand in (explicit, os.environ.get("PRECAST_OV_ANCHOR_PYTHON"), f"{ANCHOR_ENV}/bin/python"):
        if cand and Path(cand).exists():
            return cand
    return None


def anchor_env_commands(env: str = ANCHOR_ENV, torch_wheel: str | None = None) -> list[list[str]]:
    """The commands that build the anchor's environment: optimum-intel 2.2 pins transformers < 5.6 (precast tests
    5.23), and pip would pull a CUDA-built torchvision that breaks ``import optimum.intel``
    (``torchvision::nms does not exist``): torch CPU first (``torch_wheel``: a local wheel, else the CPU index),
    every pin in a constraints file, torchvision removed after."""
    pip = f"{env}/bin/pip"
    constraints = Path(env) / "constraints.txt"
    return [
        ["python3.11", "-m", "venv", env],
        [pip, "install", "-q", "--upgrade", "pip"],
        [pip, "install", "-q", torch_wheel or "torch==2.13.0"]
        + ([] if torch_wheel else ["--index-url", "https://download.pytorch.org/whl/cpu"]),
        ["sh", "-c", f"printf 'transformers<5.6\\nopenvino==2026.4.1\\n' > {constraints}"],
        [pip, "install", "-q", "-c", str(constraints), "optimum-intel[openvino]==2.2.*", "transformers<5.6"],
        [pip, "uninstall", "-y", "-q", "torchvision"],
    ]


class AnchorProcess:
    """OpenVINO's own export of the saved model (``optimum-intel``, stateful KV cache) in a persistent process of
    the anchor's environment, at one thread count; ``sample`` asks it for one (prefill, decode) sample. The
    process reports its export seconds and the resident memory it gained (a fresh process: the memory row)."""

    def __init__(
        self,
        python: str,
        model_dir: Path,
        shape: Shape,
        threads: int,
        hint: str = "bf16",
        timeout: float = 900,
    ):
        self.threads = threads
        self.proc = subprocess.Popen(
            [python, "-P", str(ANCHOR_SCRIPT)],  # -P: its folder (precast/bench/openvino.py) off sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.info = self._ask(
            {
                "model_dir": str(model_dir),
                "threads": threads,
                "hint": hint,
                "context": shape.context,
                "cache_len": shape.cache_len,
                "vocab": shape.vocab,
            },
            timeout,
        )

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(
                f"the OpenVINO anchor process ended: {err.strip().splitlines()[-1:] or 'no output'}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the OpenVINO anchor: {reply['error']}")
        return reply

    def warm(self) -> None:
        self._ask({"sample": 2}, 600)

    def sample(self, steps: int, threads: int) -> tuple[float, float]:
        reply = self._ask({"sample": steps}, 600)
        return reply["prefill_ms"], reply["decode_ms"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def save_for_anchor(model: torch.nn.Module, folder: Path) -> Path:
    """The seeded fp32 model saved with ``save_pretrained`` (the anchor exports these same weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").exists():
        model.save_pretrained(str(folder))
    return folder
