"""elastic-kv: an elastic KV cache for LLM serving engines.

The package is layered (see docs/ARCHITECTURE.md in the repository):

* :mod:`elastic_kv._vmm` -- the C++ data plane (backends, ``TensorSpace``, ``SpaceGroup``, ``HandlePool``);
* :mod:`elastic_kv.errors` -- the error types every layer raises;
* the ledger, limits, ranks and observability modules built on top.

Importing the package imports nothing heavy: the compiled data plane loads on first use of ``elastic_kv._vmm``
and never touches a GPU driver until a ``CudaBackend``/``HipBackend`` is created.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from elastic_kv.errors import ConfigError, ElasticKVError, PoolExhausted, StateConsistencyError

__all__ = ["ConfigError", "ElasticKVError", "PoolExhausted", "StateConsistencyError", "__version__"]

try:  # the repository's one VERSION file, through the installed distribution's metadata
    __version__ = _version("elastic-kv-core")
except PackageNotFoundError:  # imported from a source folder that was never installed
    __version__ = "0+unknown"
