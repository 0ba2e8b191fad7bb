"""One options record (issue 35): ``ConvertOptions``' fields are ``precast.convert``'s parameters and its records'
fields (issue 51), the rules keywords ``RulesPolicy``'s; every refusal comes from ``ConvertOptions.check`` before anything is captured; the CLI builds
the same record."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.pipeline.options import ConvertOptions
from precast.pipeline.records import RECORDS, SHORTCUTS
from precast.policy.resolve import RULE_OPTIONS


def test_every_option_has_one_place():
    """Each field of the flat record is ``convert``'s own parameter or a field of one of its records (the
    keyword of the release before naming it, ``SHORTCUTS``); the rules' options are only ``RulesPolicy``'s. A
    name renamed in one place and not the other fails here, never silently drops a value."""
    fields = {f.name for f in dataclasses.fields(ConvertOptions)} - {"rules"}
    params = set(inspect.signature(precast.convert).parameters)
    own = {"policy", "dtype", "device_type", "verify", "allow", "plan", "weights"}  # weights=PATH: the files
    new = {"weight_data": ("weights", "data")}  # record fields with no keyword of the release before
    assert own <= params and fields == own | set(SHORTCUTS) | set(new)
    assert not fields & set(RULE_OPTIONS) and not params & set(RULE_OPTIONS)
    for old, (record, field) in {**SHORTCUTS, **new}.items():
        assert field in {f.name for f in dataclasses.fields(RECORDS[record])}, old


def test_keywords_are_picked_by_name():
    options = ConvertOptions.from_keywords({"policy": "rules", "data_max": 3.0, "verify": False, "allow": ()})
    assert options.rules == {"data_max": 3.0} and options.verify is False and options.policy == "rules"
    with pytest.raises(TypeError, match="no option fallback"):
        ConvertOptions.from_keywords({"fallback": 1})
    with pytest.raises(TypeError):
        precast.convert(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), fallback=1)


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"device_type": "tpu"}, "device_type='tpu'"),
        ({"cache_dtype": "int8"}, "cache_dtype='int8'"),
        ({"keep_io_types": 1}, "keep_io_types=1"),
        ({"allow": ["nope"]}, "unknown diagnostic code"),
        ({"policy": "torch", "data_max": 3.0}, "belong to policy='rules'"),
        ({"policy": "rules", "exclude_nodes": ["("]}, "not a valid regular expression"),
        ({"policy": "rules", "tolerance": {"nope": 1}}, "unknown bound 'nope'"),
        ({"weights_out": "somewhere"}, "give weights="),
        ({"policy": "fastest"}, "policy='fastest'"),
    ],
)
def test_every_refusal_comes_before_capture(keywords, message, monkeypatch):
    """Bad options and bad mixes are refused by ConvertOptions.check, before the program is captured."""

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the options were checked")

    monkeypatch.setattr("precast.pipeline.conversion.capture", no_capture)
    with pytest.raises(PrecastError, match=message.replace("(", r"\(").replace("[", r"\[")):
        precast.convert(torch.nn.Linear(2, 2).eval(), (torch.zeros(1, 2),), **keywords)
    with pytest.raises(PrecastError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ConvertOptions.from_keywords(keywords).check()


def test_the_cli_builds_the_same_record(tmp_path):
    from precast.cli import build_parser
    from precast.cli.common import options_of

    ep = torch.export.export(torch.nn.Linear(2, 2).eval(), (torch.zeros(1, 2),))
    torch.export.save(ep, tmp_path / "p.pt2")
    argv = ["convert", str(tmp_path / "p.pt2"), "-o", str(tmp_path / "o.pt2"), "--policy", "rules"]
    args = build_parser().parse_args(
        [*argv, "--data-max", "3", "--exclude-nodes", "a", "--allow", "no-regions"]
    )
    options = options_of(args)
    assert options == ConvertOptions(
        policy="rules", rules={"exclude_nodes": ["a"], "data_max": 3.0}, allow=("no-regions",)
    )
