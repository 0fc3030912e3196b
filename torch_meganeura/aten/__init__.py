"""Op lowerings, one module per family; importing the package fills the registry."""
from . import pointwise, views, reductions, linalg, indexing, creation, scatter, random, conv, batch_norm, pooling, norms, attention  # noqa: F401
