"""OpenVINO (CPU): ``precast.compile(program, backend="openvino")``'s engine.

Before conversion, FX rewrites of the program: the precision hint and its form (``precision.py``), the forms the CPU
plugin fuses (``fusions.py``), the KV cache in the growing form it fuses with attention (``growing_cache.py``), int8 /
int4 weights in the forms it keeps compressed (``weight_forms.py``). Conversion (``convert.py``: ``convert_model``),
the KV cache as OpenVINO state (``kv_state.py``: ReadValue/Assign variables and their run-time values; tensors
in and out). After compiling: is precast's plan honoured (``plan_check.py``), which weights run compressed
(``compressed.py``), the compiled model and its calls (``model.py``: ``OpenVINOModel``), IR files written
whole (``ir_files.py``).

Input: an ExportedProgram. Output: an ``OpenVINOModel``.
"""
