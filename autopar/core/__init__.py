"""What passes and the runtime share: the mesh, the graph IR, the ``autopar::*`` ops, layouts, schedules.

``autopar.core`` imports only torch, the standard library, numpy and sympy;
``autopar.passes`` and ``autopar.runtime`` import it and never each other
(``tests/test_layering.py`` checks this).
"""
