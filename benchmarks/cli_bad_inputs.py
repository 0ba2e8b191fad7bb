"""The CLI bad-input table: every case exits 2 with one line, leaves no partial or temporary file, and leaves
its inputs byte for byte unchanged. tests/cli/test_cli_bad_inputs.py runs the same cases as a test.

    .venv/bin/python -m benchmarks.cli_bad_inputs [--out docs/cli_bad_inputs.md]   # from the repository root

Cases run in process through ``precast.cli.main`` (the same code path as ``python -m precast``, without one
interpreter start-up per case); stderr is captured per case.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import stat
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FACTORIES = """
import sys, torch
def raises():
    raise ValueError("no weights here")
def exits():
    sys.exit(7)
def wrong():
    return 3
"""
BROKEN_IMPORT = "raise RuntimeError('this module fails at import')\n"

# (name, argv with {d} for the fixture folder)
CASES: list[tuple[str, list[str]]] = [
    ("no command", []),
    ("unknown command", ["frobnicate"]),
    ("convert: missing file", ["convert", "{d}/nope.pt2", "-o", "{d}/out.pt2"]),
    ("convert: text file", ["convert", "{d}/text.pt2", "-o", "{d}/out.pt2"]),
    ("convert: zip, not a program", ["convert", "{d}/other.pt2", "-o", "{d}/out.pt2"]),
    ("convert: corrupted archive", ["convert", "{d}/corrupt.pt2", "-o", "{d}/out.pt2"]),
    ("convert: empty file", ["convert", "{d}/empty.pt2", "-o", "{d}/out.pt2"]),
    ("convert: directory as input", ["convert", "{d}/folder", "-o", "{d}/out.pt2"]),
    ("convert: pickle in sample inputs", ["convert", "{d}/evil.pt2", "-o", "{d}/out.pt2"]),
    ("convert: output is the input", ["convert", "{d}/good.pt2", "-o", "{d}/good.pt2"]),
    ("convert: output is a link to the input", ["convert", "{d}/good.pt2", "-o", "{d}/link.pt2"]),
    ("convert: output is a directory", ["convert", "{d}/good.pt2", "-o", "{d}/folder"]),
    ("convert: output folder missing", ["convert", "{d}/good.pt2", "-o", "{d}/no/such/out.pt2"]),
    (
        "convert: output on a read-only file system",
        ["convert", "{d}/good.pt2", "-o", "/proc/precast-out.pt2"],
    ),
    ("convert: missing -o", ["convert", "{d}/good.pt2"]),
    ("convert: unknown option", ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--frobnicate"]),
    ("convert: bad --dtype", ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--dtype", "fp8"]),
    ("convert: bad --policy", ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "fastest"]),
    (
        "convert: rules option without rules",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--data-max", "10"],
    ),
    (
        "convert: negative --data-max",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules", "--data-max", "-1"],
    ),
    (
        "convert: --data-max not a number",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--data-max", "big"],
    ),
    (
        "convert: bad --exclude-nodes regex",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules", "--exclude-nodes", "("],
    ),
    (
        "convert: unknown --patterns",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules", "--patterns", "nosuch"],
    ),
    ("convert: unknown --allow code", ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--allow", "nosuch"]),
    (
        "convert: missing --calibration",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules", "--calibration", "{d}/nope.pt"],
    ),
    (
        "convert: --calibration not torch.save",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/out.pt2",
            "--policy",
            "rules",
            "--calibration",
            "{d}/text.pt2",
        ],
    ),
    (
        "convert: output is the --calibration file",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/inputs.pt",
            "--policy",
            "rules",
            "--calibration",
            "{d}/inputs.pt",
        ],
    ),
    (
        "convert: --weights-out without --weights",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--weights-out", "{d}/w"],
    ),
    (
        "convert: --weights folder missing",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--weights", "{d}/nope"],
    ),
    (
        "convert: --weights folder with no safetensors",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--weights", "{d}/folder"],
    ),
    (
        "convert: missing --calibration-stats",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/out.pt2",
            "--policy",
            "rules",
            "--calibration-stats",
            "{d}/nope.json",
        ],
    ),
    (
        "convert: --calibration-stats not JSON",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/out.pt2",
            "--policy",
            "rules",
            "--calibration-stats",
            "{d}/text.pt2",
        ],
    ),
    (
        "convert: --calibration-stats of another program",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/out.pt2",
            "--policy",
            "rules",
            "--calibration-stats",
            "{d}/other.json",
        ],
    ),
    (
        "convert: --calibration and --calibration-stats",
        [
            "convert",
            "{d}/good.pt2",
            "-o",
            "{d}/out.pt2",
            "--policy",
            "rules",
            "--calibration",
            "{d}/inputs.pt",
        ]
        + ["--calibration-stats", "{d}/other.json"],
    ),
    # statistics and energies files crafted or damaged (issue 33): each refused before it decides anything
    *[
        (
            f"convert: --calibration-stats {what}",
            ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules"]
            + ["--calibration-stats", f"{{d}}/stats/{name}.json"],
        )
        for what, name in (
            ("with a NaN range", "nan"),
            ("with min > max", "unordered"),
            ("with a count of 1e400", "huge"),
            ("with a negative count", "negative"),
            ("nested 100000 deep", "deep"),
            ('with "stats": {}', "empty"),
            ("of a node the program lacks", "extra"),
            ("missing a node", "missing"),
            ("with a negative kept-batch shape", "shape"),
            ("with an unregistered type in a spec", "spec"),
        )
    ],
    (
        "convert: --calibration-stats one file twice (keep=0)",
        ["convert", "{d}/good.pt2", "-o", "{d}/out.pt2", "--policy", "rules"]
        + ["--calibration-stats", "{d}/stats/good.json", "{d}/stats/good.json"],
    ),
    *[
        (
            f"sensitivity: --energies {what}",
            [
                "sensitivity",
                "{d}/good.pt2",
                "--inputs",
                "{d}/stats/x.pt",
                "--energies",
                f"{{d}}/stats/{name}.json",
            ]
            + ["--write-energies", "{d}/e_out.json"],
        )
        for what, name in (
            ("with a NaN energy", "e_nan"),
            ("with a negative count", "e_negative"),
            ("nested 100000 deep", "e_deep"),
            ("naming a read the program lacks", "e_foreign"),
            ("missing a read", "e_missing"),
        )
    ],
    # streamed weights (issue 33): the input weights never written, only regular files read, bounded lines
    (
        "convert: --weights-out through a missing folder and .. is the input",
        [
            "convert",
            "{d}/weightless.pt2",
            "-o",
            "{d}/out.pt2",
            "--weights",
            "{d}/in",
            "--weights-out",
            "{d}/new/../in",
        ],
    ),
    (
        "convert: --weights-out through a link into the input",
        [
            "convert",
            "{d}/weightless.pt2",
            "-o",
            "{d}/out.pt2",
            "--weights",
            "{d}/in",
            "--weights-out",
            "{d}/inlink/sub",
        ],
    ),
    (
        "convert: -o names an input weights file",
        ["convert", "{d}/weightless.pt2", "-o", "{d}/in/model.safetensors", "--weights", "{d}/in"],
    ),
    (
        "convert: -o inside the input weights folder",
        ["convert", "{d}/weightless.pt2", "-o", "{d}/inlink/out.pt2", "--weights", "{d}/in"],
    ),
    (
        "convert: --weights folder holding a FIFO named *.safetensors",
        ["convert", "{d}/weightless.pt2", "-o", "{d}/out.pt2", "--weights", "{d}/fifo_w"],
    ),
    (
        "convert: --weights of another model",
        ["convert", "{d}/weightless.pt2", "-o", "{d}/out.pt2", "--weights", "{d}/other_w"],
    ),
    (
        "compile: -o inside the --weights folder",
        ["compile", "{d}/weightless.pt2", "--weights", "{d}/in", "-o", "{d}/in/pkg.pt2"],
    ),
    (
        "compile: --weights -o for a program holding its weights",
        ["compile", "{d}/good.pt2", "--weights", "{d}/in", "-o", "{d}/pkg.pt2"],
    ),
    ("convert: factory spec malformed", ["convert", "a:b:c", "-o", "{d}/out.pt2"]),
    ("convert: factory module missing", ["convert", "no_such_pkg.models:make", "-o", "{d}/out.pt2"]),
    ("convert: factory missing", ["convert", "bad_input_factories:nosuch", "-o", "{d}/out.pt2"]),
    ("convert: factory raises", ["convert", "bad_input_factories:raises", "-o", "{d}/out.pt2"]),
    ("convert: factory calls sys.exit(7)", ["convert", "bad_input_factories:exits", "-o", "{d}/out.pt2"]),
    ("convert: factory returns a number", ["convert", "bad_input_factories:wrong", "-o", "{d}/out.pt2"]),
    ("convert: factory module fails to import", ["convert", "bad_input_broken:make", "-o", "{d}/out.pt2"]),
    ("report: missing file", ["report", "{d}/nope.pt2"]),
    ("report: text file", ["report", "{d}/text.pt2"]),
    ("report: corrupted archive", ["report", "{d}/corrupt.pt2"]),
    ("report: pickle in sample inputs", ["report", "{d}/evil.pt2"]),
    ("report: output is the input", ["report", "{d}/good.pt2", "--format", "json", "-o", "{d}/good.pt2"]),
    ("report: output is a directory", ["report", "{d}/good.pt2", "-o", "{d}/folder"]),
    ("report: output folder missing", ["report", "{d}/good.pt2", "-o", "{d}/no/such/r.json"]),
    ("report: --width -5", ["report", "{d}/good.pt2", "--width", "-5"]),
    ("report: --width 0", ["report", "{d}/good.pt2", "--width", "0"]),
    ("report: --width not a number", ["report", "{d}/good.pt2", "--width", "wide"]),
    ("report: bad --format", ["report", "{d}/good.pt2", "--format", "xml"]),
    ("check: missing program", ["check", "{d}/nope.pt2"]),
    ("check: text program", ["check", "{d}/text.pt2"]),
    ("check: pickle in sample inputs", ["check", "{d}/evil.pt2"]),
    ("check: missing --inputs", ["check", "{d}/good.pt2", "--inputs", "{d}/nope.pt"]),
    ("check: --inputs not torch.save", ["check", "{d}/good.pt2", "--inputs", "{d}/text.pt2"]),
    ("check: --inputs of the wrong shape", ["check", "{d}/good.pt2", "--inputs", "{d}/wrong_inputs.pt"]),
    ("compile: missing file", ["compile", "{d}/nope.pt2"]),
    ("compile: text file", ["compile", "{d}/text.pt2", "-o", "{d}/pkg.pt2"]),
    ("compile: pickle in sample inputs", ["compile", "{d}/evil.pt2", "-o", "{d}/pkg.pt2"]),
    ("compile: output is the input", ["compile", "{d}/good.pt2", "-o", "{d}/good.pt2"]),
    (
        "compile: onnx output is the input",
        ["compile", "{d}/good.pt2", "--backend", "onnx", "-o", "{d}/good.pt2"],
    ),
    ("compile: onnx without -o", ["compile", "{d}/good.pt2", "--backend", "onnx"]),
    (
        "compile: the IR's .bin beside -o is the input",
        ["compile", "{d}/prog.bin", "--backend", "openvino", "-o", "{d}/prog.xml"],
    ),
    (
        "compile: the IR's .bin beside -o is a hard link to the input",
        ["compile", "{d}/good.pt2", "--backend", "openvino", "-o", "{d}/hard.xml"],
    ),
    (
        "convert: -o and --write-plan are one file",
        ["convert", "{d}/good.pt2", "-o", "{d}/same.pt2", "--write-plan", "{d}/same.pt2"],
    ),
    (
        "sensitivity: --write-plan is the program",
        [
            "sensitivity",
            "{d}/good.pt2",
            "--inputs",
            "{d}/inputs.pt",
            "--keep",
            "1",
            "--write-plan",
            "{d}/good.pt2",
        ],
    ),
    (
        "sensitivity: --repro would overwrite the --inputs file",
        ["sensitivity", "{d}/good.pt2", "--inputs", "{d}/rep/inputs.pt", "--repro", "{d}/rep"],
    ),
    (
        "compile: --mode with executorch",
        ["compile", "{d}/good.pt2", "--backend", "executorch", "--mode", "max-autotune", "-o", "{d}/m.pte"],
    ),
    ("compile: --cache-dir writable by others", ["compile", "{d}/good.pt2", "--cache-dir", "{d}/shared"]),
    ("compile: --cache-dir owned by another user", ["compile", "{d}/good.pt2", "--cache-dir", "{d}/theirs"]),
    ("compile: --cache-dir is a file", ["compile", "{d}/good.pt2", "--cache-dir", "{d}/text.pt2"]),
    ("report: output type not registered with pytree", ["report", "{d}/unregistered.pt2"]),
    ("generate: missing file", ["generate", "{d}/nope.pt2", "--prompt-ids", "1,2", "--max-new-tokens", "4"]),
    ("generate: not a decoder", ["generate", "{d}/good.pt2", "--prompt-ids", "1,2", "--max-new-tokens", "4"]),
    (
        "generate: bad --prompt-ids",
        ["generate", "{d}/good.pt2", "--prompt-ids", "1,x", "--max-new-tokens", "4"],
    ),
    (
        "generate: --prompt without --tokenizer",
        ["generate", "{d}/good.pt2", "--prompt", "hi", "--max-new-tokens", "4"],
    ),
    (
        "generate: --tokenizer missing",
        [
            "generate",
            "{d}/good.pt2",
            "--prompt",
            "hi",
            "--tokenizer",
            "{d}/nope.json",
            "--max-new-tokens",
            "4",
        ],
    ),
    (
        "generate: --max-new-tokens 0",
        ["generate", "{d}/good.pt2", "--prompt-ids", "1", "--max-new-tokens", "0"],
    ),
    (
        "generate: --temperature 0",
        ["generate", "{d}/good.pt2", "--prompt-ids", "1", "--max-new-tokens", "4", "--temperature", "0"],
    ),
    ("bench: --out is a file", ["bench", "--model", "mlp", "--out", "{d}/text.pt2"]),
    ("bench: --repeats 0", ["bench", "--model", "mlp", "--repeats", "0"]),
    ("bench: --batch 0", ["bench", "--model", "mlp", "--batch", "0"]),
    ("bench: unknown model", ["bench", "--model", "nosuch"]),
    ("bench: factory raises", ["bench", "--model", "bad_input_factories:raises", "--variant", "eager_fp32"]),
    (
        "bench: factory calls sys.exit(7)",
        ["bench", "--model", "bad_input_factories:exits", "--variant", "eager_fp32"],
    ),
    ("bench: factory module fails to import", ["bench", "--model", "bad_input_broken:make"]),
    ("bench: --convert --sizes 0", ["bench", "--convert", "--model", "chain", "--sizes", "0"]),
]


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor


class _ReturnsOutput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(x * 2)


def _save_unregistered(path: Path) -> None:
    """A program whose output type is registered with pytree only while it is saved (transformers'
    CausalLMOutputWithPast in a process that has not imported transformers)."""
    from torch.utils import _pytree as pytree

    pytree.register_dataclass(_Output, serialized_type_name="bad_inputs.Output")
    try:
        torch.export.save(torch.export.export(_ReturnsOutput(), (torch.ones(2),)), str(path))
    finally:
        pytree._deregister_pytree_node(_Output)


def make_fixtures(d: Path) -> None:
    """The files the cases read: a good program, broken ones, a pickle-carrying one, factories, cache dirs."""
    import precast
    from precast.examples import seed_model

    model, inputs = seed_model()
    good = d / "good.pt2"
    torch.export.save(precast.convert(model, inputs).program, str(good))
    (d / "text.pt2").write_text("not a program\n")
    (d / "empty.pt2").write_bytes(b"")
    with zipfile.ZipFile(d / "other.pt2", "w") as z:
        z.writestr("hello.txt", "a zip, but not a saved program")
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as z:  # flip bytes inside the largest member: its CRC no longer matches
        big = max(z.infolist(), key=lambda i: i.compress_size)
        start = big.header_offset + 30 + len(big.filename.encode()) + len(big.extra)
    for i in range(start + 10, start + 60):
        data[i] ^= 0xFF
    (d / "corrupt.pt2").write_bytes(bytes(data))
    payload = io.BytesIO()
    torch.save(_Marker(), payload, pickle_module=pickle)  # refused before it is unpickled
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(d / "evil.pt2", "w") as dst:
        for info in src.infolist():
            blob = src.read(info.filename)
            dst.writestr(info, payload.getvalue() if "/data/sample_inputs/" in info.filename else blob)
    (d / "link.pt2").symlink_to(good)
    _save_unregistered(d / "unregistered.pt2")
    (d / "folder").mkdir()
    torch.save((torch.randn(4, 128),), d / "inputs.pt")
    torch.save((torch.randn(4, 7),), d / "wrong_inputs.pt")
    (d / "prog.bin").write_bytes(good.read_bytes())  # a program whose name is an IR's weights file
    os.link(good, d / "hard.bin")  # the weights file of -o hard.xml, a hard link to good.pt2
    (d / "rep").mkdir()
    torch.save((torch.randn(4, 128),), d / "rep" / "inputs.pt")  # where --repro rep writes its inputs.pt
    import precast

    # statistics of another program, for --calibration-stats
    precast.calibrate(torch.nn.Linear(4, 4), [(torch.randn(2, 4),)], (torch.randn(2, 4),)).save(
        d / "other.json"
    )
    stats_fixtures(d / "stats", good, inputs)
    _weights_fixtures(d)
    (d / "bad_input_factories.py").write_text(FACTORIES)
    (d / "bad_input_broken.py").write_text(BROKEN_IMPORT)
    (d / "shared").mkdir(mode=0o700)
    (d / "shared").chmod(0o777)
    (d / "theirs").mkdir(mode=0o700)
    if hasattr(os, "getuid") and os.getuid() == 0:
        os.chown(d / "theirs", 12345, 12345)


def stats_fixtures(d: Path, good: Path, inputs: tuple) -> None:
    """A calibration (keep=0), a kept-batch one and energies of ``good``'s program, and damaged or crafted copies
    (the JSON edited; a sample file's sha256 rewritten to pass its check)."""
    import json
    import struct

    import precast

    d.mkdir()
    ep = torch.export.load(str(good))
    torch.save(inputs, d / "x.pt")
    precast.calibrate(ep, [inputs], keep=0).save(d / "good.json")
    precast.calibrate(ep, [inputs], keep=1).save(d / "kept.json")
    from precast.cli import main

    argv = ["sensitivity", str(good), "--inputs", str(d / "x.pt"), "--write-energies", str(d / "e.json")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    doc = json.loads((d / "good.json").read_text())
    node = next(k for k, v in doc["stats"].items() if v["count"])

    def crafted(name: str, edit, src: str = "good.json") -> None:
        x = json.loads((d / src).read_text())
        edit(x)
        (d / f"{name}.json").write_text(json.dumps(x))

    crafted("nan", lambda x: x["stats"][node].update(min=float("nan")))
    crafted("unordered", lambda x: x["stats"][node].update(min=x["stats"][node]["max"] + 1))
    crafted("huge", lambda x: x["stats"][node].update(count=987654321987))
    (d / "huge.json").write_text((d / "huge.json").read_text().replace("987654321987", "1e400"))
    crafted("negative", lambda x: x["stats"][node].update(nonfinite=-4))
    (d / "deep.json").write_text(
        '{"format": "precast-calibration", "stats": ' + "[" * 100000 + "]" * 100000 + "}"
    )
    crafted("empty", lambda x: x.update(stats={}))
    crafted("extra", lambda x: x["stats"].update(linear_99=x["stats"][node]))
    crafted("missing", lambda x: x["stats"].pop(node))
    # the kept batch's safetensors header with a negative shape (the same element count), its sha256 rewritten
    kept = json.loads((d / "kept.json").read_text())
    blob = (d / "kept.sample.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [-header[name]["shape"][0], -header[name]["shape"][1], *header[name]["shape"][2:]]
    raw = json.dumps(header).encode()
    bad = struct.pack("<Q", len(raw)) + raw + blob[8 + size :]
    (d / "shape.sample.safetensors").write_bytes(bad)
    kept["sample"].update(file="shape.sample.safetensors", sha256=hashlib.sha256(bad).hexdigest())
    (d / "shape.json").write_text(json.dumps(kept))
    spec = json.loads((d / "kept.json").read_text())
    tree = json.loads(spec["sample"]["batches"][0]["spec"])
    tree[1]["type"] = "no.such.Module"
    spec["sample"]["batches"][0]["spec"] = json.dumps(tree)
    (d / "spec.json").write_text(json.dumps(spec))
    e = json.loads((d / "e.json").read_text())
    crafted("e_nan", lambda x: x["energy"][0].__setitem__(2, float("nan")), "e.json")
    crafted("e_negative", lambda x: next(iter(x["ranges"].values())).__setitem__(3, -5), "e.json")
    (d / "e_deep.json").write_text(
        '{"format": "precast-energies", "energy": ' + "[" * 100000 + "]" * 100000 + "}"
    )
    crafted("e_foreign", lambda x: x["energy"][0].__setitem__(0, "no_such_node"), "e.json")
    crafted("e_missing", lambda x: x["energy"].pop(), "e.json")
    assert e["energy"], "the fixture's energies hold no read"


def _weights_fixtures(d: Path) -> None:
    """A program exported without its weights (weightless.pt2), its weights (in/, linked as inlink), the same
    beside a FIFO named like a shard (fifo_w/), and another model's weights (other_w/)."""
    from safetensors.torch import save_file

    import precast

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(12))).eval()
    torch.export.save(precast.export_weightless(model, (torch.randn(2, 8),)), str(d / "weightless.pt2"))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name in ("in", "fifo_w", "other_w"):
        (d / name).mkdir()
    save_file(state, str(d / "in" / "model.safetensors"))
    save_file(state, str(d / "fifo_w" / "model.safetensors"))
    os.mkfifo(d / "fifo_w" / "zz.safetensors")
    save_file({f"blocks.{k}": v for k, v in state.items()}, str(d / "other_w" / "model.safetensors"))
    (d / "inlink").symlink_to(d / "in")


# Python API cases: (name, code run with `precast`, `torch` and `D` (the fixture folder, a Path) in scope)
API_CASES: list[tuple[str, str]] = [
    (
        "convert: weights_out through a missing folder and .. is the input",
        "precast.convert(weightless(), weights=precast.WeightOptions(files=D / 'in', out=str(D / 'new') + '/../in'))",
    ),
    (
        "convert: weights_out through a link into the input",
        "precast.convert(weightless(), weights=precast.WeightOptions(files=D / 'in', out=D / 'inlink' / 'sub'))",
    ),
    (
        "convert: weights folder holding a FIFO named *.safetensors",
        "precast.convert(weightless(), weights=precast.WeightOptions(files=D / 'fifo_w', out=D / 'o'))",
    ),
    (
        "convert: weights of another model",
        "precast.convert(weightless(), weights=precast.WeightOptions(files=D / 'other_w', out=D / 'o'))",
    ),
    (
        "with_weights: weights of another model",
        "precast.with_weights(weightless(), D / 'other_w')",
    ),
]


def run_api_case(d: Path, name: str, code: str) -> Outcome:
    """``code`` run in process: exit 2 stands for a one-line ``PrecastError``, 1 for anything else raised, 0 for
    none; ``changed`` as for the CLI cases."""
    import precast
    from precast.pipeline.load import load_program

    scope = {
        "precast": precast,
        "torch": torch,
        "D": d,
        "weightless": lambda: load_program(d / "weightless.pt2"),
    }
    before = snapshot(d)
    status, message = 0, ""
    try:
        exec(code, scope)  # noqa: S102 - the table's own code
    except precast.PrecastError as exc:
        status, message = 2, str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded in the table as the failure it is
        status, message = 1, f"{type(exc).__name__}: {exc}"
    after = snapshot(d)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return Outcome(name, code.replace("D / ", "D/"), status, message, "", changed, api=True)


class _Marker:
    def __reduce__(self):
        return (print, ("this pickle ran",))


def snapshot(d: Path) -> dict[str, str]:
    """Every path under ``d`` (hidden ones included) with the sha256 of its bytes: outputs and leftovers show."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_symlink() or p.is_dir():
            out[str(p.relative_to(d))] = "link" if p.is_symlink() else "dir"
        elif not stat.S_ISREG(p.lstat().st_mode):
            out[str(p.relative_to(d))] = "special"  # a FIFO: never opened (it would wait for a writer)
        else:
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Outcome:
    name: str
    command: str
    status: int
    stderr: str
    stdout: str
    changed: list[str]
    api: bool = False  # a Python API case: "exit 2" stands for a one-line PrecastError


def run_case(d: Path, name: str, argv: list[str]) -> Outcome:
    from precast.cli import main

    args = [a.format(d=d) for a in argv]
    before = snapshot(d)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = main(args)
        except SystemExit as exc:  # argparse exits itself
            status = exc.code if isinstance(exc.code, int) else 1
    after = snapshot(d)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    command = "precast " + " ".join(a.replace(str(d), "D") for a in args)
    return Outcome(name, command, status, err.getvalue(), out.getvalue(), changed)


def run_all(d: Path) -> list[Outcome]:
    make_fixtures(d)
    sys.path.insert(0, str(d))
    try:
        return [run_case(d, name, argv) for name, argv in CASES] + [
            run_api_case(d, name, code) for name, code in API_CASES
        ]
    finally:
        sys.path.remove(str(d))


def to_markdown(outcomes: list[Outcome], d: Path) -> str:
    ok = sum(o.status == 2 and len(o.stderr.strip().splitlines()) == 1 and not o.changed for o in outcomes)
    cli = [o for o in outcomes if not o.api]
    api = [o for o in outcomes if o.api]
    lines = [
        "# CLI bad-input table",
        "",
        f"{len(outcomes)} cases ({len(cli)} CLI, {len(api)} Python API), {ok} exit 2 (the API: raise one "
        "PrecastError) with one line on stderr, no output or temporary file, inputs "
        "unchanged. Generated by `python -m benchmarks.cli_bad_inputs --out docs/cli_bad_inputs.md` "
        f"(torch {torch.__version__}); `D` is the fixture folder. tests/cli/test_cli_bad_inputs.py runs the same cases.",
        "",
        "| case | command | exit | stderr (one line) | files changed |",
        "|---|---|---|---|---|",
    ]
    lines += [_row(o, d) for o in cli]
    if api:
        lines += [
            "",
            "## Python API",
            "",
            "The same bad inputs through the API: exit 2 here means one `PrecastError` of one line (the message "
            "shown), nothing written, inputs unchanged.",
            "",
            "| case | call | exit | error (one line) | files changed |",
            "|---|---|---|---|---|",
        ]
        lines += [_row(o, d) for o in api]
    return "\n".join(lines) + "\n"


def _row(o: Outcome, d: Path) -> str:
    first = o.stderr.strip().splitlines()[0] if o.stderr.strip() else ""
    first = first.replace("|", "\\|")
    first = first.replace(str(d), "D").replace("\x1b[1m", "").replace("\x1b[0m", "")
    return f"| {o.name} | `{o.command}` | {o.status} | {first} | {', '.join(o.changed) or 'none'} |"


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="precast-bad-inputs-") as d:
        outcomes = run_all(Path(d))
        text = to_markdown(outcomes, Path(d))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    bad = [o.name for o in outcomes if o.status != 2 or len(o.stderr.strip().splitlines()) != 1 or o.changed]
    print(
        f"{len(outcomes)} cases, {len(bad)} not exit 2 + one line + nothing changed: {bad}", file=sys.stderr
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
