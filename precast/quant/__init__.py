"""precast.quant: weight formats, one concept with one home.

How a linear's or an embedding's weight is stored in 8 or 4 bits, and everything that follows from it:

  formats.py      the formats (``Int8``, ``Int8Asym``, ``Int4``, ``Float``): spelling, arithmetic, stored cost  [ir]
  presets.py      named presets (llama.cpp's Q4_K_M choice) as rules                                        [ir]
  rules.py        which format each weight gets: one format, glob patterns, one rule per weight name        [ir]
  forms.py        the graph form of each format: its writer and its recogniser (the engines import it)  [ir]
  rounding.py     data-aware int4: per-group step/zero search on input importance, GPTQ                  [ir]
  activation_stats.py  input statistics of a model's linears on calibration data                    [ir]
  graph.py        the pass that writes the stored parts and the dequantizing ops into a program            [passes]
  probes.py       the estimate's probes where each weight is read                                          [numerics]
  estimate.py     each weight's error per format (Fisher), the knapsack (``allocate``)                      [numerics]
  budget.py       ``precast.Budget``: formats chosen under a budget, counted as stored                       [pipeline]
  sensitivity.py  ``precast.weight_sensitivity``: each weight's error in each format, curves, plans           [api]

The modules span layers (a format is ir-level data, the writer is a pass, the sensitivity runs conversions):
``tests/arch/test_layers.py`` places each module of this folder on its own layer. This package's face imports only
the lowest of them (formats, rules), so importing it never pulls a higher layer in.
"""

from precast.quant.formats import WeightFormat, parse_format
from precast.quant.rules import WeightRules, weight_rules

__all__ = ["WeightFormat", "WeightRules", "parse_format", "weight_rules"]
