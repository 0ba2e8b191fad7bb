"""The program as precast works on it: ``Program`` (a private copy of an ExportedProgram), mutation and aliasing,
fake tensors, graph vocabulary, regions as data, input binding, diagnostics records.

Input/output: see each module; nothing here decides precision or runs a stage.
"""
