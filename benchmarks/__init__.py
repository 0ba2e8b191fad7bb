"""precast's benchmarks (a source checkout only; not part of the installed package).

The scripts here (run from the repository root: ``python -m benchmarks.NAME``) use ``precast.bench``, what
``precast bench`` runs, and their own helpers in ``benchmarks/harness/``: all-MiniLM-L6-v2 with its real weights
(``harness.minilm``; ``precast bench --model benchmarks.harness.minilm:bench_model`` from here), and OpenVINO's
own export in the optimum-intel environment (``harness.decode_anchor``, the anchor of the decode scripts).
"""
