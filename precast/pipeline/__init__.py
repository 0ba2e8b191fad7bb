"""The conversion driver: capture (and the checked .pt2 reading), the checks before any decision, the
policy's prepare steps, the conversion state (``conversion.Conversion``: begin, lower, relower), the checks after
lowering, verification. The graph rewrites are in ``precast.passes``, what runs the program to measure it in
``precast.numerics``, weight files in ``precast.weights``; ``precast.api.convert`` drives them in order.
"""
