"""Calibration statistics and sensitivity energies files are untrusted input (issue 33, item 5): every number
finite and in range, counts non-negative integers, ranges ordered, the JSON's nesting bounded before it is
parsed, the kept batches' safetensors header and pytree specs checked before torch reads them, the statistics of
exactly the program's measured nodes (energies: of exactly its tapped reads and ranked ops), and the same
measurement never merged twice, whatever ``keep``. Each refusal is one line (a ``PrecastError``)."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from pathlib import Path

import pytest

import precast
from precast.errors import PrecastError
from precast.numerics.calibration.checks import measured_nodes
from tests.numerics.dist_worker import CONVERT, case


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("calfiles")
    ep, batches = case()
    cal = precast.calibrate(ep, batches[:3], dtype="fp16", keep=2)
    cal.save(d / "cal.json")
    bare = precast.calibrate(ep, batches[:3], dtype="fp16", keep=0)
    bare.save(d / "bare.json")
    s = precast.sensitivity(ep, batches[0], dtype="fp16", data=batches[:2])
    s.energies.save(d / "e.json")
    return ep, batches, d, s


def refused(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(PrecastError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def first_node(doc: dict) -> str:
    return next(k for k, v in doc["stats"].items() if v["count"] > 0)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("min", float("nan"), "not finite and ordered"),
        ("max", float("nan"), "not finite and ordered"),
        ("absmax", float("nan"), "absmax nan"),
        ("min", "inf", "not finite and ordered"),
        ("swap", None, "not finite and ordered"),  # min > max
        ("absmax", 1e30, "not the largest magnitude"),
        ("count", "1e400", "count of .* is inf, not an integer"),  # JSON's 1e400 reads as a float infinity
        ("count", 10**400, "outside"),
        ("count", -1, "outside"),
        ("nonzero", 2.5, "not an integer"),
        ("batches", True, "not an integer"),
        ("subnormal", 10**9, "contradict"),
    ],
    ids=lambda v: str(v)[:16],
)
def test_impossible_statistics_are_refused(setup, tmp_path, field, value, match):
    _, _, d, _ = setup
    doc = json.loads((d / "bare.json").read_text())
    s = doc["stats"][first_node(doc)]
    if field == "swap":
        s["min"], s["max"] = s["max"] + 1, s["max"]
    else:
        s[field] = 987654321987 if value == "1e400" else value
    (tmp_path / "c.json").write_text(
        json.dumps(doc).replace("987654321987", "1e400")
    )  # NaN as json writes it
    refused(match, precast.load_calibration, tmp_path / "c.json")


def test_file_counts_and_keep_are_bounded(setup, tmp_path):
    _, _, d, _ = setup
    for field, value in (("batches", -3), ("batches", 1e400), ("keep", 10**12), ("keep", "8")):
        doc = json.loads((d / "bare.json").read_text())
        doc[field] = value
        refused(r"malformed \(ValueError", precast.load_calibration, write(tmp_path / "c.json", doc))


def test_deeply_nested_json_is_refused_before_parsing(setup, tmp_path):
    """A nesting that exhausts json's recursion (RecursionError on today's code) is one line, found by a scan of
    the raw text; brackets inside strings do not count."""
    _, _, d, _ = setup
    for name, fmt, load in (
        ("c.json", "precast-calibration", precast.load_calibration),
        ("e.json", "precast-energies", precast.load_energies),
    ):
        deep = f'{{"format": "{fmt}", "version": 1, "stats": ' + "[" * 200_000 + "]" * 200_000 + "}"
        (tmp_path / name).write_text(deep)
        refused("nested more than 32 deep", load, tmp_path / name)
    doc = json.loads((d / "bare.json").read_text())
    doc["source"] = "[[[[" * 100  # brackets in a string are text
    assert precast.load_calibration(write(tmp_path / "ok.json", doc)).source == "[[[[" * 100


def test_statistics_must_cover_exactly_the_program(setup, tmp_path):
    ep, batches, d, _ = setup
    doc = json.loads((d / "bare.json").read_text())
    names = measured_nodes(precast.ir.program.Program(ep).graph)
    assert set(doc["stats"]) <= set(names) and len(doc["stats"]) >= len(names) - 1
    empty = dict(doc, stats={})
    refused(
        "no statistics for", precast.convert, ep, calibration=write(tmp_path / "a.json", empty), **CONVERT
    )
    missing = copy.deepcopy(doc)
    missing["stats"].pop(first_node(doc))
    refused(
        "no statistics for 1 of",
        precast.convert,
        ep,
        calibration=write(tmp_path / "b.json", missing),
        **CONVERT,
    )
    extra = copy.deepcopy(doc)
    extra["stats"]["linear_99"] = extra["stats"][first_node(doc)]
    msg = refused(
        "statistics of 1 node.s. the program does not have .linear_99.",
        precast.convert,
        ep,
        calibration=write(tmp_path / "c.json", extra),
        **CONVERT,
    )
    assert len(msg) < 400


def test_the_same_measurement_merged_twice_is_refused_whatever_keep(setup, tmp_path):
    ep, batches, d, _ = setup
    for name in ("bare.json", "cal.json"):  # keep=0 and keep=2
        one = precast.load_calibration(d / name)
        refused("both hold measurement", one.merge, precast.load_calibration(d / name))
        refused("both hold measurement", precast.convert, ep, calibration=[d / name, d / name], **CONVERT)
    bare = precast.load_calibration(d / "bare.json")
    refused("both hold measurement", bare.merge, bare)
    # a merge holds its parts: merging it with one of them again is refused too
    other = precast.calibrate(ep, batches[3:5], dtype="fp16", keep=0)
    refused("both hold measurement", bare.merge(other).merge, other)
    both = bare.merge(other)
    both.save(tmp_path / "both.json")
    assert precast.load_calibration(tmp_path / "both.json").parts == both.parts and len(both.parts) == 2
    # a file written before measurement ids: its own sha256 identifies it
    doc = json.loads((d / "bare.json").read_text())
    del doc["parts"]
    old = write(tmp_path / "old.json", doc)
    refused("both hold measurement", precast.load_calibration(old).merge, precast.load_calibration(old))
    doc["parts"] = ["a1", "a1"]
    refused("listed twice", precast.load_calibration, write(tmp_path / "twice.json", doc))
    # two measurements of distinct batches still merge
    assert bare.merge(other).batches == 5


def _retag(json_path: Path, side: Path, data: bytes) -> None:
    """Write ``data`` as the sample file and its sha256 into the JSON (a file crafted to pass the hash)."""
    side.write_bytes(data)
    doc = json.loads(json_path.read_text())
    doc["sample"]["sha256"] = hashlib.sha256(data).hexdigest()
    json_path.write_text(json.dumps(doc))


def _with_header(data: bytes, edit) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + size :]


def test_kept_batch_header_and_spec_are_checked_before_torch_reads_them(setup, tmp_path):
    ep, batches, d, _ = setup
    for f in ("cal.json", "cal.sample.safetensors"):
        (tmp_path / f).write_bytes((d / f).read_bytes())
    j, side = tmp_path / "cal.json", tmp_path / "cal.sample.safetensors"
    good = side.read_bytes()
    name = next(k for k in json.loads(good[8 : 8 + struct.unpack("<Q", good[:8])[0]]) if k != "__metadata__")

    def negative(h):
        shape = h[name]["shape"]
        h[name]["shape"] = [-shape[0], -shape[1], *shape[2:]]  # the same element count

    _retag(j, side, _with_header(good, negative))
    refused("shape of .* is not a list of non-negative integers", precast.load_calibration, j)

    def unknown(h):
        h[name]["dtype"] = "Q7"

    _retag(j, side, _with_header(good, unknown))
    refused("not a complete safetensors file", precast.load_calibration, j)
    _retag(j, side, good)
    assert len(precast.load_calibration(j).sample) == 2
    doc = json.loads(j.read_text())
    spec = json.loads(doc["sample"]["batches"][0]["spec"])
    spec[1]["type"] = "no.such.Module"  # a type no pytree registration knows
    doc["sample"]["batches"][0]["spec"] = json.dumps(spec)
    refused("names a type this process cannot build", precast.load_calibration, write(j, doc))
    doc["sample"]["batches"][0]["spec"] = "[" * 5000 + "]" * 5000
    refused("nests more than 32 deep", precast.load_calibration, write(j, doc))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda doc: doc["energy"][0].__setitem__(2, float("nan")), "not finite"),
        (lambda doc: doc["energy"][0].__setitem__(2, -1.0), "not finite and >= 0"),
        (lambda doc: next(iter(doc["ranges"].values())).__setitem__(3, -5), "outside"),
        (lambda doc: next(iter(doc["ranges"].values())).__setitem__(2, 1e400), "not an integer"),
        (lambda doc: next(iter(doc["ranges"].values())).__setitem__(0, float("nan")), "absmax of"),
        (lambda doc: doc.__setitem__("batches", -1), "outside"),
        (lambda doc: doc["energy"].append(list(doc["energy"][0])), "given twice"),
    ],
)
def test_impossible_energies_are_refused(setup, tmp_path, edit, match):
    _, _, d, _ = setup
    doc = json.loads((d / "e.json").read_text())
    edit(doc)
    refused(match, precast.load_energies, write(tmp_path / "e.json", doc))


def test_energies_must_cover_exactly_the_programs_reads(setup, tmp_path):
    ep, batches, d, s = setup
    reused = precast.sensitivity(ep, batches[0], dtype="fp16", energies=d / "e.json")
    assert reused.estimate.order == s.estimate.order
    doc = json.loads((d / "e.json").read_text())
    foreign = copy.deepcopy(doc)
    foreign["energy"][0][0] = "no_such_node"  # a KeyError traceback on today's code
    refused(
        "energies of 1 read.s. the program does not have .no_such_node->",
        precast.sensitivity,
        ep,
        batches[0],
        dtype="fp16",
        energies=write(tmp_path / "a.json", foreign),
    )
    missing = copy.deepcopy(doc)
    missing["energy"].pop()
    refused(
        "no energies for 1 read",
        precast.sensitivity,
        ep,
        batches[0],
        dtype="fp16",
        energies=write(tmp_path / "b.json", missing),
    )
    ranges = copy.deepcopy(doc)
    ranges["ranges"]["linear_99"] = [1.0, None, 0, 0]
    refused(
        "op range.s. the program does not have .linear_99",
        precast.sensitivity,
        ep,
        batches[0],
        dtype="fp16",
        energies=write(tmp_path / "c.json", ranges),
    )
