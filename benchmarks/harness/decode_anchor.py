"""The decode harness's anchor (``precast.bench.decode``): OpenVINO's own export of the same saved weights
(optimum-intel) in another Python environment (optimum-intel 2.2 needs transformers < 5.6), one persistent
process per thread count, so its samples interleave with the in-process forms' repeat by repeat.

- ``ANCHOR_ENV``, ``anchor_python``, ``anchor_env_commands``, ``build_anchor_env``: where the anchor's
  environment lives, its Python, the commands that build it and their run (``python -m benchmarks.llm_decode
  --build-anchor-env``).
- ``anchor_in_process``: the anchor's IR loaded by this process's OpenVINO (``openvino_anchor_inprocess``).
- ``AnchorProcess``: one persistent process of ``ov_anchor.py`` at one thread count, sampled as (prefill ms,
  ms per decoded token).
- ``save_for_anchor``: the seeded fp32 model saved with ``save_pretrained`` (the anchor exports these weights).
- ``build_anchor``, ``build_anchor_inprocess``: the anchor forms' builders, registered with the decode harness
  (``precast.bench.decode.forms.register``) when this module is imported: the package itself never builds them.

Input: the anchor's Python, a saved model, a shape, a thread count. Output: samples, export seconds, RSS.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import platformdirs
import torch

from benchmarks.harness.ov_anchor import ir_dir
from precast.bench.decode.forms import ANCHOR, Build, Variant, module_state, register, weight_format_of
from precast.bench.decode.model import Shape, llama, read_bytes, wrapped

# where `python -m benchmarks.llm_decode --build-anchor-env` builds the anchor's environment (optimum-intel pins transformers
# < 5.6); $PRECAST_OV_ANCHOR_PYTHON or --anchor-python point elsewhere
ANCHOR_ENV = str(Path(platformdirs.user_data_dir("precast")) / "ov-anchor")
ANCHOR_SCRIPT = Path(__file__).with_name("ov_anchor.py")
OPENVINO_PIN = "2026.4.1"  # precast[openvino]'s: the anchor and precast's OpenVINO forms run the same runtime


def anchor_python(explicit: str | None = None) -> str | None:
    """The Python of the anchor's environment: ``explicit``, ``$PRECAST_OV_ANCHOR_PYTHON``, or ``ANCHOR_ENV``'s;
    None where none exists."""
    for cand in (explicit, os.environ.get("PRECAST_OV_ANCHOR_PYTHON"), f"{ANCHOR_ENV}/bin/python"):
        if cand and Path(cand).exists():
            return cand
    return None


# pip fails fast where an index is unreachable: one try, 15 s per connection (pip's default retries 5 times with
# back-off, minutes per package, before it says anything)
PIP_FAST = ["--retries", "0", "--timeout", "15"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def anchor_env_commands(
    env: str = ANCHOR_ENV,
    torch_wheel: str | None = None,
    python: str | None = None,
    torch_version: str | None = None,
) -> list[list[str]]:
    """The commands that build the anchor's environment: optimum-intel 2.2 pins transformers < 5.6 (precast tests
    5.23), and its dependencies would replace torch with a CUDA build of another release, and pull a CUDA-built
    torchvision that breaks ``import optimum.intel`` (``torchvision::nms does not exist``). So: a venv of the
    running interpreter (``python``, default ``sys.executable``); the running torch's release (``torch_version``,
    default ``torch.__version__``) as a CPU build first (``torch_wheel``: a local wheel, else the CPU index, with
    the lane's own pip configuration, which may point at local wheels); every pin (that torch included) in a
    constraints file for the rest; torchvision removed after. Every pip call fails fast (``PIP_FAST``)."""
    python = python or sys.executable
    version = torch_version or torch.__version__
    pip = [f"{env}/bin/python", "-m", "pip"]
    constraints = Path(env) / "constraints.txt"
    pins = f"torch=={version.split('+')[0]}\ntransformers<5.6\nopenvino=={OPENVINO_PIN}\n"
    torch_cmd = [torch_wheel] if torch_wheel else [f"torch=={version}", "--index-url", TORCH_CPU_INDEX]
    if not torch_wheel and "+" not in version:  # a build without a local label (PyPI's): its CPU twin
        torch_cmd[0] = f"torch=={version}+cpu"
    return [
        [python, "-m", "venv", env],
        [
            f"{env}/bin/python",
            "-c",
            "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
            str(constraints),
            pins,
        ],
        [*pip, "install", "-q", *PIP_FAST, *torch_cmd],
        [
            *pip,
            "install",
            "-q",
            *PIP_FAST,
            "-c",
            str(constraints),
            "optimum-intel[openvino]==2.2.*",
            "transformers<5.6",
        ],
        [*pip, "uninstall", "-y", "-q", "torchvision"],
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
        weight_format: str | None = None,
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
                **({"weight_format": weight_format} if weight_format else {}),
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


def infer_logits(request: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One call of an optimum-intel stateful decoder's infer request, fed as optimum-intel feeds it: ``input_ids``
    at ``positions`` (the state holds the earlier ones), an all-ones attention mask up to the last position,
    beam 0. Returns the logits (a copy)."""
    import numpy as np

    request.infer(
        {
            "input_ids": input_ids.numpy(),
            "attention_mask": np.ones((1, int(positions[-1]) + 1), np.int64),
            "position_ids": positions[None].numpy(),
            "beam_idx": np.zeros(1, np.int32),
        }
    )
    return torch.from_numpy(request.get_output_tensor(0).data.copy())


def window_runner(request: Any) -> Any:
    """``run(ids) -> logits``: a whole window from an empty state (the accuracy scripts' form of the anchor)."""

    def run(ids: torch.Tensor) -> torch.Tensor:
        request.reset_state()
        return infer_logits(request, ids, torch.arange(ids.shape[1]))[0].float()

    return run


def anchor_in_process(anchor: Any, folder: Path, threads: tuple[int, ...]) -> tuple[Any, str]:
    """The anchor's IR in this process: one infer request per thread count (bf16 hint and KV cache, as the anchor's
    own process), fed as optimum-intel feeds it; the state reset where a call starts at position 0. ``anchor``:
    the ``openvino_anchor`` form of the same run (its export of the weights)."""
    if anchor is None or anchor.anchors is None or not (folder / "openvino_model.xml").exists():
        raise RuntimeError("needs openvino_anchor in the same run (its export of the weights)")
    import openvino as ov

    theirs = anchor.anchors[threads[0]].info.get("versions", {}).get("openvino")
    if theirs != ov.__version__:
        raise RuntimeError(f"OpenVINO here is {ov.__version__}, the anchor's {theirs}: not the same runtime")
    config = {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16", "PERFORMANCE_HINT": "LATENCY"}
    core = ov.Core()
    requests = {
        t: core.compile_model(
            str(folder / "openvino_model.xml"), "CPU", {**config, "INFERENCE_NUM_THREADS": str(t)}
        ).create_infer_request()
        for t in threads
    }

    def run(input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        request = requests[torch.get_num_threads()]
        if int(cache_position[0]) == 0:
            request.reset_state()
        return infer_logits(request, input_ids, cache_position)

    return run, f"the anchor's IR in this process ({ov.__version__}), a bare infer request"


def build_anchor_env(env: str, torch_wheel: str | None = None, log: Any = print) -> None:
    """Run ``anchor_env_commands``, each logged; the first that fails raises RuntimeError with its last line of
    output (pip's own reason: an unreachable index, a version it cannot find)."""
    for cmd in anchor_env_commands(env, torch_wheel):
        log("+ " + " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            why = next(
                (ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output"
            )
            raise RuntimeError(f"`{' '.join(cmd[:6])} ...` failed: {why}; {env} is partial")


# ---- the anchor forms of the decode harness -------------------------------------------------------------
def build_anchor(b: Build, v: Variant) -> None:
    """OpenVINO's own export of the same weights, in the anchor's environment: one process per thread count."""
    python = anchor_python(b.anchor)
    if python is None:
        raise RuntimeError(
            f"no anchor environment ({ANCHOR_ENV}; build it with python -m benchmarks.llm_decode "
            "--build-anchor-env, or give --anchor-python)"
        )
    folder = save_for_anchor(b.fp32, b.work / f"anchor-{b.tag}")
    fmt = weight_format_of(v.name)
    v.anchors = {t: AnchorProcess(python, folder, b.shape, t, weight_format=fmt) for t in b.threads}
    first = v.anchors[b.threads[0]].info
    v.compile_s, v.rss_mb = first.get("export_s"), first.get("rss_mb")
    how = f"optimum-cli --weight-format {fmt}" if fmt else "optimum-intel export"
    v.note = f"{how}, bf16 hint + bf16 KV cache; {first.get('versions')}"
    v.run, v.reloadable = (lambda **kw: None), "-"
    if fmt:  # the IR's weight file: every weight, its scales and zero points
        bin_bytes = (Path(ir_dir(str(folder), fmt)) / "openvino_model.bin").stat().st_size
        v.stored_bytes = {"weights": bin_bytes}
        return
    v.stored_bytes, v.read_bytes = _run_bytes(b)


def _run_bytes(b: Build) -> tuple[dict[str, int], int]:
    """The bytes the export's f32 IR holds and reads per token as OpenVINO runs it here: its weights in bf16 under
    the bf16 hint where the CPU has native bf16 (the hand-cast bf16 model's bytes), in f32 where OpenVINO's default
    is f32 (no native bf16: the bf16 hint is not taken there)."""
    import openvino as ov

    from precast.backends.openvino.precision import native_bf16

    dtype = torch.bfloat16 if native_bf16(ov.Core()) else torch.float32
    return read_bytes(module_state(wrapped(llama(b.shape, dtype), b.shape).model))


def build_anchor_inprocess(b: Build, v: Variant) -> None:
    v.run, v.note = anchor_in_process(b.variants.get(ANCHOR), b.work / f"anchor-{b.tag}-ov", b.threads)
    v.reloadable = "-"
    v.stored_bytes, v.read_bytes = _run_bytes(b)


register(
    {
        ANCHOR: build_anchor,
        "openvino_anchor_int8": build_anchor,
        "openvino_anchor_int4": build_anchor,
        "openvino_anchor_inprocess": build_anchor_inprocess,
    }
)
