"""The call contract every engine and ``precast.llm`` share, independent of the engine: the program handed to a
backend (``exported.py``), what a compiled program accepts, checked before native code runs (``signature.py``, with
the cache positions of ``positions.py`` and the size expressions of ``sizes.py``), who holds a stateful model
(``owner.py``), and tensors as the numpy arrays engines take and give (``arrays.py``, bfloat16 as its bits).

Input: an ExportedProgram (or its manifest). Output: checks and facts about calls, no engine code.
"""
