"""Which lane runs a test that does not need both (``./dev.sh test`` runs the suite twice: the floor lane, torch
2.13.0, and the latest lane, torch 2.15.0, side by side on CI's two cores; the whole run must stay under 45 minutes).

Every test runs in both lanes except those below: each entry is a test id prefix (a file, a test, or one
parametrization), the one lane that runs it, and why one lane is enough. What is listed is precast's own logic that
no torch version changes (argument checks, file trust, caches and locks, the CLI's exits, benchmark harnesses), a
flow whose version-dependent parts other tests check in both lanes, or one of several parametrizations of the
same check, split so each runs on one torch; and (``REALMODEL_POLICY_LANE``) the transformers real-model tier's
policies torch and rules, one dtype per lane. ``PRECAST_LANE`` unset (pytest run by hand): everything runs.

The floor lane also runs what only it can (the bare install, the real SmolLM2 weights); the latest lane the vision
real-model tier (torchvision and timm exist only there).
"""

from __future__ import annotations

FLOOR, LATEST = "floor", "latest"

_CACHE = "the compile cache's own logic (keys, locks, atomic entries, copies): precast's code, the same on every torch"
_CLI = "the CLI's argument checks, messages and exit codes: precast's code; the conversions behind them run in both lanes"
_SWAP = (
    "precast's own checks around one compiled model (load_weights, a copy's weights, state after a swap); "
    "AOTInductor's compile and load of converted programs run in both lanes (test_outputs_equal_converted_program, "
    "the load_weights swap tests, tests/backends/aoti/test_load_weights.py)"
)
_BENCH = "a benchmark harness's tables and arithmetic (no timing is asserted); the forms it builds are tested in both lanes"
_OV = (
    "OpenVINO running precast's programs of real decoders: OpenVINO's side is the same in both lanes, and the torch "
    "side (export, conversion) of these families is checked in both by the rest of tests/realmodels/test_llm.py"
)

ONE_LANE: dict[str, tuple[str, str]] = {
    # ---- floor lane only ----
    "tests/backends/aoti/test_package_cache_trust.py": (
        FLOOR,
        "which files and caches precast trusts, and its atomic writes: its own code",
    ),
    "tests/backends/aoti/test_compile.py::test_two_processes_on_a_cold_key_compile_once": (FLOOR, _CACHE),
    "tests/backends/aoti/test_compile.py::test_killed_compile_leaves_no_loadable_entry": (FLOOR, _CACHE),
    "tests/backends/aoti/test_compile.py::test_tampered_entry_is_rebuilt": (FLOOR, _CACHE),
    "tests/backends/aoti/test_compile.py::test_second_compile_in_fresh_process_loads_fast": (FLOOR, _CACHE),
    "tests/backends/aoti/test_compile.py::test_cli_compile_copies_package": (FLOOR, _CACHE),
    "tests/backends/aoti/test_compile.py::test_cnn_state_dict_with_unread_buffers_reloads": (FLOOR, _SWAP),
    "tests/backends/aoti/test_compile.py::test_compile_of_a_modified_copy_uses_the_copys_weights": (
        FLOOR,
        _SWAP,
    ),
    "tests/backends/aoti/test_compile.py::test_load_weights_accepts_state_dict_without_non_persistent_buffers": (
        FLOOR,
        _SWAP,
    ),
    "tests/backends/aoti/test_compile.py::test_a_stateful_compile_after_load_weights_starts_from_the_program": (
        FLOOR,
        _SWAP,
    ),
    "tests/backends/aoti/test_compile.py::test_load_weights_equals_fresh_compile_bitwise": (FLOOR, _SWAP),
    "tests/realmodels/test_llm.py::test_policy_torch_program_route": (
        FLOOR,
        "policy torch given the exported program: the same autocast tables as the module route, which runs in both "
        "lanes on every family (test_policy_torch_module_route_bitwise_equal_to_eager_autocast)",
    ),
    "tests/realmodels/test_llm.py::test_rules_and_auto_finite_and_close_to_fp32": (
        FLOOR,
        "rules and auto on the decoders (finite, close to fp32): precast's rules; the same families' exports and "
        "conversions run in both lanes, and rules on transformers models runs in the latest lane in "
        "tests/realmodels/test_realmodels.py",
    ),
    "tests/cli/test_cli.py": (FLOOR, _CLI),
    "tests/cli/test_cli_bad_inputs.py": (FLOOR, _CLI),
    "tests/cli/test_cli_generate.py": (FLOOR, _CLI),
    "tests/cli/test_cli_llm_export.py": (
        FLOOR,
        "precast export-llm's flow (files, progress, refusals, the artifact); the weight formats it stores are tested "
        "in both lanes (tests/passes/test_quantize.py), and the floor lane holds the real SmolLM2 weights",
    ),
    "tests/llm/test_export_api.py": (
        FLOOR,
        "precast.llm.export, the flow export-llm runs, called from Python and compared with the command's folder: "
        "the same flow as tests/cli/test_cli_llm_export.py, which runs in the floor lane",
    ),
    "tests/bench": (FLOOR, _BENCH),
    "tests/llm/test_folder.py": (
        LATEST,
        "precast.load of an export-llm folder: the folder format and opening the engines' saved forms, precast's "
        "own code over OpenVINO's and AOTInductor's loaders, which both lanes test (tests/backends); the export "
        "flow itself runs in the floor lane (tests/cli/test_cli_llm_export.py)",
    ),
    "tests/numerics/test_distributed.py": (
        FLOOR,
        "statistics reduced across torchrun ranks over gloo: torch.distributed's stable API; the statistics are "
        "tested in both lanes in one process",
    ),
    # ---- one parametrization in each lane: the same check on the other dtype or family ----
    "tests/backends/aoti/test_compile.py::test_load_weights_swaps_every_weight_whatever_its_size[bf16-region]": (
        FLOOR,
        "the fp16-region case runs in the latest lane, no-region in both",
    ),
    "tests/backends/aoti/test_compile.py::test_load_weights_swaps_every_weight_whatever_its_size[fp16-region]": (
        LATEST,
        "the bf16-region case runs in the floor lane, no-region in both",
    ),
    "tests/realmodels/test_llm.py::test_aoti_decode_matches_converted_program[llama-torch-bf16]": (
        FLOOR,
        "one compiled decoder per family and lane: gemma2 in the latest lane",
    ),
    "tests/realmodels/test_llm.py::test_aoti_decode_matches_converted_program[qwen2-auto-bf16-cache]": (
        FLOOR,
        "one compiled decoder per family and lane: gemma2 in the latest lane",
    ),
    "tests/realmodels/test_llm.py::test_aoti_decode_matches_converted_program[gemma2-rules-fp16]": (
        LATEST,
        "one compiled decoder per family and lane: llama and qwen2 in the floor lane",
    ),
    # ---- latest lane only ----
    "tests/test_docs_llm.py": (
        LATEST,
        "the README's and docs' LLM steps run as written, with the torch `pip install precast` gets today",
    ),
    "tests/realmodels/test_openvino_realmodels.py": (LATEST, _OV.replace("decoders", "models")),
    "tests/realmodels/test_llm.py::test_openvino_decode_matches_converted_program": (LATEST, _OV),
    "tests/realmodels/test_llm.py::test_openvino_ir_decodes_in_a_process_without_precast": (LATEST, _OV),
    "tests/realmodels/test_llm.py::test_openvino_reset_and_two_models_keep_their_own_state": (LATEST, _OV),
    "tests/realmodels/test_llm.py::test_openvino_cut_back_a_bf16_cache_is_a_fresh_start_there": (LATEST, _OV),
}


# tests/realmodels/test_realmodels.py: each transformers model runs policy None in both lanes (the export of its
# autocast regions is what changes between torch versions), and the other policies split between the lanes, so
# each lane converts every family under a policy torch and a policy rules, in the other dtype than the other lane
REALMODEL_POLICY_LANE = {"torch-bf16": FLOOR, "rules-fp16": FLOOR, "torch-fp16": LATEST, "rules-bf16": LATEST}
REALMODEL_POLICY_WHY = (
    "the transformers models' policies split between the lanes: every family runs policy None, policy torch and "
    "policy rules in each lane, one dtype each (the dtype is a parameter of the same lowering)"
)


def matches(prefix: str, nodeid: str) -> bool:
    """Whether ``prefix`` names the test ``nodeid``: the same id, or a file, folder, test or parametrization
    above it (never a longer name that merely starts the same)."""
    return nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "[", prefix + "/"))


def lane_of(nodeid: str) -> tuple[str, str] | None:
    """The (lane, why) of the longest entry that names ``nodeid``, or None (both lanes)."""
    named = [prefix for prefix in ONE_LANE if matches(prefix, nodeid)]
    return ONE_LANE[max(named, key=len)] if named else None
