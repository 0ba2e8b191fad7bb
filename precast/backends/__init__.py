"""Engines a converted program is handed to: AOTInductor (``precast.compile`` and its cache), ONNX and ONNX
Runtime, ExecuTorch.

Input: an ExportedProgram. Output: the artifact each engine loads, and ways to run it.
"""
