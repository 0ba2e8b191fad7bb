"""The tolerance search: which ops to keep in fp32 so a conversion's outputs meet a tolerance. Its logic, pure
(``search``: ``parse_tolerance``, ``rank``, ``meet_tolerance``, the estimate's ``Source``), and the runs it asks
for (``stage``: ``tolerance_stage`` the pipeline's prepare step runs, ``tolerance_check`` the report's
measurement, and the program copies and runs sensitivity shares: ``lowered_copy``, ``check_program``,
``user_outputs``).
"""

from precast.numerics.tolerance.search import Source, meet_tolerance, parse_tolerance, rank
from precast.numerics.tolerance.stage import (
    check_program,
    lowered_copy,
    tolerance_check,
    tolerance_stage,
    user_outputs,
)

__all__ = [
    "Source",
    "check_program",
    "lowered_copy",
    "meet_tolerance",
    "parse_tolerance",
    "rank",
    "tolerance_check",
    "tolerance_stage",
    "user_outputs",
]
