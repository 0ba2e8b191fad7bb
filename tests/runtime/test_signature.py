"""ProgramSignature: a compiled engine's inputs checked against the program's input specs before native code runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch.export import Dim

from precast.errors import PrecastError
from precast.runtime.signature import ProgramSignature


class TwoInputs(torch.nn.Module):
    def forward(self, x, y, *, mask):
        return x[:, :4] @ y + mask


@pytest.fixture(scope="module")
def signatures():
    batch = Dim("batch", min=1, max=64)
    ep = torch.export.export(
        TwoInputs(),
        (torch.randn(2, 8), torch.randn(4, 5)),
        {"mask": torch.randn(2, 5)},
        dynamic_shapes=({0: batch}, None, {0: batch}),
    )
    sig = ProgramSignature.from_program(ep)
    # the manifest form reads back to a signature that checks the same way
    return sig, ProgramSignature.from_dict(json.loads(json.dumps(sig.to_dict())))


def ok_inputs(batch=3):
    return (torch.randn(batch, 8), torch.randn(4, 5)), {"mask": torch.randn(batch, 5)}


@pytest.mark.parametrize("which", [0, 1])
def test_valid_call_returns_flat_inputs_in_program_order(signatures, which):
    args, kwargs = ok_inputs(7)
    flat = signatures[which].check(args, kwargs)
    assert [t is u for t, u in zip(flat, [*args, kwargs["mask"]], strict=True)] == [True] * 3


BAD = [
    # (args, kwargs, words the one-line error must contain)
    ((torch.randn(3, 9), torch.randn(4, 5)), {"mask": torch.randn(3, 5)}, ["'x'", "(s", ", 8)", "(3, 9)"]),
    ((torch.randn(3, 8), torch.randn(4, 6)), {"mask": torch.randn(3, 5)}, ["'y'", "(4, 5)", "(4, 6)"]),
    ((torch.randn(3, 8, 1), torch.randn(4, 5)), {"mask": torch.randn(3, 5)}, ["'x'", "(3, 8, 1)"]),
    ((torch.randn(3, 8).double(), torch.randn(4, 5)), {"mask": torch.randn(3, 5)}, ["'x'", "float64"]),
    (
        (torch.randn(3, 8), torch.randn(4, 5)),
        {"mask": torch.randn(2, 5)},
        ["'mask'", "another input gives as 3"],
    ),
    ((torch.randn(0, 8), torch.randn(4, 5)), {"mask": torch.randn(0, 5)}, ["'x'", "[1, 64]"]),
    ((torch.randn(65, 8), torch.randn(4, 5)), {"mask": torch.randn(65, 5)}, ["'x'", "[1, 64]"]),
    ((torch.randn(3, 8),), {"mask": torch.randn(3, 5)}, ["takes x (args[0]), y (args[1])", "1 positional"]),
    ((torch.randn(3, 8), torch.randn(4, 5)), {"mas": torch.randn(3, 5)}, ["keywords ['mas']"]),
    (("x.png", torch.randn(4, 5)), {"mask": torch.randn(3, 5)}, ["'x'", "expected a tensor, got str"]),
]


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_wrong_inputs_raise_one_line_naming_the_argument(signatures, which, case):
    args, kwargs, words = BAD[case]
    with pytest.raises(PrecastError) as err:
        signatures[which].check(args, kwargs)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_malformed_dict_is_a_precast_error(signatures):
    data = signatures[0].to_dict()
    data["inputs"][0]["dtype"] = "Tensor"  # a torch attribute that is not a dtype
    with pytest.raises(PrecastError, match="malformed"):
        ProgramSignature.from_dict(data)
    with pytest.raises(PrecastError, match="malformed"):
        ProgramSignature.from_dict({"inputs": 3})


def test_compound_size_is_checked():
    class Cat(torch.nn.Module):
        def forward(self, a, b):
            return torch.cat([a, a]) + b

    n = Dim("n", min=1)
    ep = torch.export.export(
        Cat(), (torch.randn(3, 2), torch.randn(6, 2)), dynamic_shapes=({0: n}, {0: 2 * n})
    )
    sig = ProgramSignature.from_program(ep)
    sig.check((torch.randn(4, 2), torch.randn(8, 2)), {})
    with pytest.raises(PrecastError, match="'b'.*must be 2"):
        sig.check((torch.randn(4, 2), torch.randn(7, 2)), {})


class _Renamed(torch.nn.Module):
    """A cache written at positions computed from an input with no telling name (``where + 0``), and a
    second input the write does not index: the cache's length is read from the graph, not from names."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kv", torch.zeros(2, 5, 3))

    def forward(self, tokens: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        self.kv.index_copy_(1, where + 0, tokens.float().unsqueeze(-1).expand(2, -1, 3))
        return self.kv.sum(1) + tokens.float().sum()


def test_cache_positions_read_from_the_graph():
    from precast.runtime.signature import cache_positions

    ep = torch.export.export(_Renamed(), (torch.ones(2, 1, dtype=torch.long), torch.tensor([0])))
    assert cache_positions(ep) == {"where": 5}
    sig = ProgramSignature.from_program(ep)
    assert ProgramSignature.from_dict(sig.to_dict()).positions == {"where": 5}
    ok = (torch.ones(2, 1, dtype=torch.long), torch.tensor([4]))
    assert len(sig.check(ok, {})) == 2
    with pytest.raises(
        PrecastError, match=r"'where' \(args\[1\]\): cache position 5 outside the cache, which holds 5"
    ):
        sig.check((ok[0], torch.tensor([5])), {})
    # a program without a cache has no positions; an older manifest without the key reads as none
    plain = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    assert cache_positions(plain) == {}
    data = ProgramSignature.from_program(ep).to_dict()
    del data["positions"]
    assert ProgramSignature.from_dict(data).positions == {}
