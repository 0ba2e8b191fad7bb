"""precast's benchmarks (a source checkout only; not part of the installed package).

``precast.bench.models``: the models ``precast bench --model NAME`` resolves short names against;
``precast.bench.minilm``: all-MiniLM-L6-v2 in plain PyTorch with its real weights (optional packages);
``benchmarks/aoti_mlp.py``, ``benchmarks/convert_cost.py``: scripts (run from the repository root).
"""
