"""AOTInductor: ``precast.compile(program)``'s engine (``compiler.py``; the facts and decisions it hands down:
``facts.py``), a cache entry built and published (``build.py``) and loaded (``load.py``), the package cache on disk
(``package_cache.py``), the loaded model (``model.py``: ``CompiledModel``; its ``load_weights`` phases:
``swap.py``), the CPU form chosen by measurement (``forms.py``, timed by ``form_timing.py``), weights read through
packed copies (``packed.py``), and int8 / int4 weights read in the kernel (``int_weights.py``, applied by
``int_rewrite.py``).

Input: an ExportedProgram. Output: a ``CompiledModel`` backed by a cached ``.pt2`` package.
"""
