"""aten to IR: the op table (``registry``: aten overload -> lowering) and the lowerings (``aten``, one module per op
family), the decompositions handed to aot_autograd (``decompositions``), a graph's device partitions and eager
fallbacks with their reasons (``partition``), an fx graph into the IR (``fx_lowering``), a dynamic graph's sizes
(``symbolic``), and the ``tune`` and ``precision`` options (``tuning``).
"""
