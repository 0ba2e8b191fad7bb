"""Policy "rules": options, op taxonomy, measures, precision-sensitive patterns, the decider, the tolerance search.

Input/output: see ``policy.py`` (``RulesPolicy`` -> ``RulesDecider``).
"""
