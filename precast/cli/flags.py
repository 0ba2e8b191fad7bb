"""Flags more than one ``precast`` command takes, defined once.

Input: an argparse parser. Output: the parser with the flag added.
"""

from __future__ import annotations

import argparse


def add_trust_pickle(parser: argparse.ArgumentParser) -> None:
    """``--trust-pickle``: load a .pt2 that needs a full unpickle (``precast/pipeline/archive.py``)."""
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a .pt2 whose sample inputs or constants need a full unpickle (it can run code: trusted files only)",
    )
