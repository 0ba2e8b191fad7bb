"""Precision policies: eager autocast tables and semantics, the torch policy, rules.

Input: op nodes with fake arguments. Output: Decisions (pure data; nothing here rewrites a graph).
"""
