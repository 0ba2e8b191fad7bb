"""Decoders: a transformers checkpoint exported to the folder ``precast.load`` runs (``export``, also
``precast.export_llm``), generation on compiled or exported decoders (``generate``), and the wrapper that exports a
causal LM for a full-sequence forward (``LogitsOnly``).

Input: a checkpoint (``export``), or a decoder program exported with transformers' recipe (or a model compiled from
one). Output: the folder, tokens.
"""

from precast.llm.exporter import ExportedFolder, export, export_with
from precast.llm.generate import GenerationResult, ProgramModel, generate
from precast.llm.wrappers import LogitsOnly

__all__ = [
    "ExportedFolder",
    "GenerationResult",
    "LogitsOnly",
    "ProgramModel",
    "export",
    "export_with",
    "generate",
]
