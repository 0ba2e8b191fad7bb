"""Real third-party architectures (transformers, timm, torchvision, all-MiniLM-L6-v2 with real weights)."""
