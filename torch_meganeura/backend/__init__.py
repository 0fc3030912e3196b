"""The dynamo backend: its entry (``entry``: ``meganeura_backend``) and validated options (``options``), the
per-call path (``per_call``: a device partition, one plan per input signature; ``bound_plan``: an entry of one,
replayed as bound; ``signatures``: what selects it), what a forward saves for its backward (``saved_values``) and
how it hands that over, one pack per device partition (``packed``), the gradients of kept parameters parked on them
(``parked_grads``), ``explain``, and the pipeline that the backend, the training step and export share
(``device_graph``: fx graph -> plan -> program).
"""
