"""Calibration: the program run once over the user's data, streaming, for per-op value statistics (``stage``:
``calibrate``, the ``calibrate_stage`` the pipeline's prepare step runs), those statistics checked against the
program they are for (``checks``: ``measured_nodes``, the kept batches ``TOLERANCE_BATCHES``), and statistics
files read as untrusted input (``files``: ``load_calibration``).

The statistics themselves, what policies read, are ``precast.policy.measurements``' records.
"""

from precast.numerics.calibration.checks import TOLERANCE_BATCHES, measured_nodes
from precast.numerics.calibration.files import load_calibration
from precast.numerics.calibration.stage import batches_of, calibrate, calibrate_stage, is_given

__all__ = [
    "TOLERANCE_BATCHES",
    "batches_of",
    "calibrate",
    "calibrate_stage",
    "is_given",
    "load_calibration",
    "measured_nodes",
]
