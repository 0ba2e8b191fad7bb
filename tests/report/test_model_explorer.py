"""precast's Model Explorer node data (``precast report OUT.pt2 --format model-explorer``) against Google's Model
Explorer itself (``ai-edge-model-explorer``): its node-data classes, its PyTorch ExportedProgram adapter's node
ids, and its web app rendering the overlay in headless Chromium.

``PRECAST_WRITE_DOCS_IMAGES=1`` also writes the screenshot to docs/images/model_explorer_overlay.png.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "model_explorer", reason="ai-edge-model-explorer is not installed (pip install 'precast[model-explorer]')"
)

import precast  # noqa: E402
from precast.cli import main  # noqa: E402
from precast.report.render import DTYPE_COLOR  # noqa: E402
from tests import models as zoo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CAST_COLOR = "#f08a5d"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The seed model converted, saved, and its node data written by the CLI."""
    d = tmp_path_factory.mktemp("me")
    model, inputs = zoo.seed_model()
    res = precast.convert(model, inputs)
    torch.export.save(res.program, d / "seed.pt2")
    assert (
        main(["report", str(d / "seed.pt2"), "--format", "model-explorer", "-o", str(d / "seed.json")]) == 0
    )
    return d


def test_node_data_parses_into_model_explorer_classes(files):
    """Built into the package's own dataclasses (unknown keys raise TypeError) and written back by the package,
    the file comes out the same, plus the package's defaults for the optional fields precast leaves out."""
    from model_explorer import node_data_builder as ndb

    data = json.loads((files / "seed.json").read_text())
    graphs = {
        gid: ndb.GraphNodeData(
            results={k: ndb.NodeDataResult(**v) for k, v in g["results"].items()},
            thresholds=[ndb.ThresholdItem(**t) for t in g["thresholds"]],
            **{k: v for k, v in g.items() if k not in ("results", "thresholds")},
        )
        for gid, g in data.items()
    }
    model = ndb.ModelNodeData(graphsData=graphs)
    # the package writes its defaults for the fields precast leaves out (gradient, hide* flags)
    defaults = json.loads(ndb.GraphNodeData(results={}).to_json_string())
    expected = {gid: {**defaults, **g} for gid, g in data.items()}
    assert json.loads(model.to_json_string()) == expected
    out = files / "roundtrip.json"
    model.save_to_file(str(out))
    assert json.loads(out.read_text()) == expected


def test_node_ids_are_the_adapter_ids(files):
    """The graph id and node ids are those Model Explorer's PyTorch ExportedProgram adapter assigns to the
    program loaded from the file; every op precast decided a dtype for has a value there."""
    from model_explorer.consts import DEFAULT_SETTINGS
    from model_explorer.pytorch_exported_program_adapter_impl import PytorchExportedProgramAdapterImpl

    ep = torch.export.load(files / "seed.pt2")
    (graph,) = PytorchExportedProgramAdapterImpl(ep, DEFAULT_SETTINGS).convert()["graphs"]
    nodes = {n.id: n for n in graph.nodes}
    data = json.loads((files / "seed.json").read_text())
    assert list(data) == [graph.id]
    results = data[graph.id]["results"]
    assert set(results) <= set(nodes)
    rep = precast.report(ep)
    decided = {r.name for r in rep.nodes if r.dtype in ("bf16", "fp16", "fp32", "fp64")}
    assert decided | {c.name for c in rep.casts} == set(results)
    # the ids point at the ops they describe
    assert nodes["linear"].label == "aten.linear" and results["linear"]["value"] == 16
    assert nodes["linear_2"].label == "aten.linear" and results["linear_2"]["value"] == 32
    for cast in rep.casts:
        assert nodes[cast.name].label in ("aten._to_copy", "aten.to")
        assert results[cast.name]["bgColor"] == CAST_COLOR


# ---- the web app, rendered --------------------------------------------------------------------------------
SERVE = """
import sys, torch, model_explorer
ep = torch.export.load(sys.argv[1])
config = model_explorer.config().add_model_from_pytorch("seed", ep).add_node_data_from_path(sys.argv[2])
model_explorer.visualize_from_config(config, host="127.0.0.1", port=int(sys.argv[3]), no_open_in_browser=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"Model Explorer's server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/check_health", timeout=2) as r:
                if r.read() == b"model_explorer_ok":
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"Model Explorer's server did not answer in {timeout} s: {log.read_text()[-2000:]}")


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced PNG, with the standard library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line[j] for k in range(0, stride, bpp) for j in range(k, k + 3)))
        prev = line
    return width, height, rows


def _count(rows: list[bytes], hex_color: str, x_max: int) -> int:
    rgb = bytes.fromhex(hex_color.removeprefix("#"))
    return sum(row[: 3 * x_max][i : i + 3] == rgb for row in rows for i in range(0, 3 * x_max, 3))


def test_model_explorer_renders_the_overlay(files, tmp_path):
    """Model Explorer's server (its Python API, a free localhost port, no browser opened) with the program and
    the node data file, rendered by headless Chromium: the node-data panel lists precast's values and the graph
    pane paints the op nodes in precast's dtype colours."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
    )
    chromium = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("chromium or chromedriver is not installed (apt-get install chromium chromium-driver)")

    port, log = _free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(files / "seed.pt2"), str(files / "seed.json"), str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    try:
        _wait_healthy(port, server, log)
        # the URL the server prints, plus the pane state "flatten layers" so that every op node is on screen
        state = {
            "models": [{"url": "graphs://seed/0"}],
            "nodeData": [str(files / "seed.json")],
            "nodeDataTargets": [""],
            "uiState": {
                "paneStates": [
                    {
                        "flattenLayers": True,
                        "deepestExpandedGroupNodeIds": [],
                        "selectedNodeId": "",
                        "selectedGraphId": "graph",
                        "selectedCollectionLabel": "seed",
                        "widthFraction": 1,
                    }
                ]
            },
        }
        url = f"http://127.0.0.1:{port}/?data={urllib.parse.quote(json.dumps(state))}"
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--use-angle=swiftshader",
            "--enable-unsafe-swiftshader",
            "--window-size=1400,900",
            "--hide-scrollbars",
        ):
            opts.add_argument(arg)
        from selenium.webdriver.chrome.service import Service

        browser = webdriver.Chrome(service=Service(driver_path), options=opts)
        png = tmp_path / "model_explorer_overlay.png"
        try:
            browser.get(url)
            deadline, text, rows, counts = time.monotonic() + 60, "", [], {}
            while time.monotonic() < deadline:
                time.sleep(1)
                text = browser.execute_script("return document.body.innerText")
                if "precast dtype" not in text or "aten.linear" not in text:
                    continue
                browser.save_screenshot(str(png))
                width, height, rows = png_pixels(png.read_bytes())
                graph_pane = int(width * 0.7)  # the side panel (right) repeats the colours in its table
                counts = {c: _count(rows, c, graph_pane) for c in (DTYPE_COLOR["bf16"], CAST_COLOR)}
                if all(n > 500 for n in counts.values()):
                    break
            canvases = browser.execute_script("return document.querySelectorAll('canvas').length")
        finally:
            browser.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)

    # the app loaded the graph and parsed the node data file: the provider's name and the ops' values
    assert "precast dtype" in text, text[:2000]
    assert "aten.linear" in text and "aten.relu" in text
    assert canvases >= 1
    # the PNG is not blank, and the graph pane has bf16 nodes (blue) and casts (orange) painted
    assert len({px for row in rows[::20] for px in (row[i : i + 3] for i in range(0, len(row), 60))}) > 10
    assert all(n > 500 for n in counts.values()), counts
    if os.environ.get("PRECAST_WRITE_DOCS_IMAGES") == "1":
        (ROOT / "docs" / "images").mkdir(exist_ok=True)
        shutil.copyfile(png, ROOT / "docs" / "images" / "model_explorer_overlay.png")
