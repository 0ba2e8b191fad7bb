"""Print the real-model table: per model and policy, the measured agreement and the conversion time with and
without verification. Not a test (nothing asserted); run it as

    .venv/bin/python -m tests.realmodels.table [MODEL ...]

policy None: bitwise vs the unconverted program, else max |diff|; torch: bitwise vs eager autocast, else max
|diff|; rules: lowest row cosine vs fp32 eager. Times are wall-clock seconds of ``precast.convert`` (verify on /
``verify=False``), on whatever machine runs it.
"""

from __future__ import annotations

import sys
import time
import warnings

import pytest
import torch

from tests.realmodels.builders import BATCHES
from tests.realmodels.conftest import BUILDERS, POLICIES, Zoo


def _cell(zoo: Zoo, name: str, policy_id: str) -> str:
    model = zoo.model(name)
    res = zoo.convert(name, policy_id).result
    policy, dtype = POLICIES[policy_id]
    got_module = res.program.module()
    want_module = model.policy_none_source()[1].module() if policy is None else model.module
    worst_diff, worst_cos, bitwise = 0.0, 1.0, True
    with torch.no_grad():
        for b in BATCHES:
            x = model.built.inputs[b]
            got = got_module(*x)
            if policy == "torch":
                with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
                    want = want_module(*x)
            else:
                want = want_module(*x)
            bitwise &= got.dtype == want.dtype and bool(torch.equal(got, want))
            g, w = got.double(), want.double()
            worst_diff = max(worst_diff, (g - w).abs().max().item())
            rows = torch.nn.functional.cosine_similarity(
                g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
            )
            worst_cos = min(worst_cos, rows.min().item())
    if policy in ("rules", "auto"):
        return f"cos {worst_cos:.6f}"
    return "bitwise" if bitwise else f"diff {worst_diff:.3g}"


def _timed(zoo: Zoo, name: str, policy_id: str, verify: bool) -> str:
    start = time.perf_counter()
    try:
        zoo.convert(name, policy_id, verify=verify)
    except Exception as exc:
        return f"fail ({type(exc).__name__})"
    return f"{time.perf_counter() - start:.1f}"


def main(names: list[str]) -> None:
    warnings.filterwarnings("ignore")
    zoo = Zoo()
    print("| model | " + " | ".join(POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for name in names or sorted(BUILDERS):
        try:
            zoo.model(name)
        except pytest.skip.Exception as exc:
            print(f"| {name} | skipped: {str(exc)[:120]} |")
            continue
        cells = []
        for policy_id in POLICIES:
            t_off = _timed(zoo, name, policy_id, verify=False)
            t_on = _timed(zoo, name, policy_id, verify=True)
            try:
                value = _cell(zoo, name, policy_id)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                value = f"FAIL {type(exc).__name__}: {first[:80]}"
            cells.append(f"{value}; {t_on} s / {t_off} s")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
