"""What runs the program to measure it: calibration (the pass that measures its statistics, their checks and
files; the values themselves are ``precast.policy.measurements``), latency, the tolerance search (its logic and
the simulation that feeds it), probes, sensitivity, sensitivity energies, the first non-finite op, and the
reduction of statistics and energies over a process group.
"""
