"""Decoders: generation on compiled or exported decoders (``generate``), and the wrapper that exports a causal LM
for a full-sequence forward (``LogitsOnly``).

Input: a decoder program exported with transformers' recipe (or a model compiled from one). Output: tokens.
"""

from precast.llm.generate import GenerationResult, ProgramModel, generate
from precast.llm.wrappers import LogitsOnly

__all__ = ["GenerationResult", "LogitsOnly", "ProgramModel", "generate"]
