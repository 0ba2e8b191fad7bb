"""A stored constant recomputed from its original weight, for the readers above the passes (a compiled model's
``load_weights``, the streamed writer): ``stored_value(source, original)`` casts, or quantizes and picks the part
(``ConstantSource.derive``). The formats themselves: ``precast.quant.formats``; the pass that writes them into
the graph: ``precast.quant.graph``."""

from __future__ import annotations

from precast.quant.formats import WeightFormat, parse_format, parse_tag, quantized_part
from precast.quant.graph import stored_value

__all__ = ["WeightFormat", "parse_format", "parse_tag", "quantized_part", "stored_value"]
