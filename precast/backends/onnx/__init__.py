"""ONNX: a converted program exported as an ``.onnx`` file (``export.py``) and run in ONNX Runtime on the CPU
(``runtime.py``).

Input: an ExportedProgram. Output: an ``.onnx`` file, ONNX Runtime sessions and runs.
"""
