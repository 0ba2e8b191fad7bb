"""The report of a conversion: the model (``Report``), building it from node meta, rendering it.

Note: ``precast.report`` (the name on the package) is the function ``precast.report.build.report``; import the
modules of this package by their full names (``precast.report.model``).
"""
