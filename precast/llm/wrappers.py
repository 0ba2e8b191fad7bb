"""``LogitsOnly``: a causal LM's forward as one tensor in, one tensor out, for ``torch.export``.

transformers' ``AutoModelForCausalLM`` returns a ``CausalLMOutputWithPast`` holding a ``DynamicCache``: torch.export
refuses the cache in the output ("Found DynamicCache in output"), and a program whose output is that dataclass saves
but cannot be loaded where transformers has not registered it with pytree. This wrapper runs the model without a
cache (``use_cache=False``) and returns ``.logits``: the full-sequence program ``precast.export_weightless``,
streamed conversion and ``precast check`` work on (docs/streaming.md). For token-by-token decode with a KV cache
export with transformers' recipe instead (README, "LLMs").

Input: a causal LM module. Output: a module ``forward(input_ids) -> logits``.
"""

from __future__ import annotations

import torch


class LogitsOnly(torch.nn.Module):
    """``forward(input_ids) -> model(input_ids=input_ids, use_cache=False).logits``; the model is ``self.model``
    (the program's names gain a ``model.`` prefix, which a streamed conversion matches to the files' names)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits
