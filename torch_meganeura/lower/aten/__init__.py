"""Op lowerings, one module per family; importing the package fills the registry.

Modules: ``pointwise`` (elementwise math and activations), ``views`` (views folded into index math),
``reductions`` (and softmax, layer norm), ``linalg`` (matmuls), ``indexing`` (embedding, index_select, gather,
advanced indexing), ``creation`` (full, arange and the like), ``scatter``, ``random`` (the counter-based device RNG),
``conv`` (convolutions as implicit GEMM), ``batch_norm`` (eval mode), ``pooling``, ``norms`` (group norm),
``attention`` (scaled dot-product attention).
"""
from . import (pointwise, views, reductions, linalg, indexing, creation, scatter, random, conv,  # noqa: F401
               batch_norm, pooling, norms, attention)
