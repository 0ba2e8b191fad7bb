"""Weights outside memory: safetensors files read one tensor at a time (``files``), the converted weights written
shard by shard (``streamed``), a program without its weights' values made runnable (``filled``), exporting a model
without its weights (``weightless``), and the source a compiled model's weights are loaded from (``sources``).
"""
