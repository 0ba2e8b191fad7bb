"""Precision policies: eager autocast tables and semantics, the torch policy, rules."""
