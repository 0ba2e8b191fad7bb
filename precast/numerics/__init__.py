"""What runs the program to measure it: calibration (its statistics as a mergeable value and the pass that
measures them), latency, the tolerance search (its logic and the simulation that feeds it), probes, sensitivity,
sensitivity energies, the first non-finite op, and the reduction of statistics and energies over a process group.
"""
