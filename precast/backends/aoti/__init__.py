"""AOTInductor: ``precast.compile(program)``'s engine (``compiler.py``), a cache entry built, published and loaded
(``build.py``), the package cache on disk (``package_cache.py``), the loaded model (``model.py``: ``CompiledModel``),
the CPU form chosen by measurement (``forms.py``, timed by ``form_timing.py``), weights read through packed copies
(``packed.py``), and int8 / int4 weights read in the kernel (``int_weights.py``, applied by ``int_rewrite.py``).

Input: an ExportedProgram. Output: a ``CompiledModel`` backed by a cached ``.pt2`` package.
"""
