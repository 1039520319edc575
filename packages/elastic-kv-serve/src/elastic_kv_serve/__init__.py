"""elastic-kv serve: many models on one device behind one OpenAI endpoint.

Engines (vLLM, SGLang) run as child processes with ``--kv-cache-backend=elastic``; a supervisor starts,
restarts, sleeps and wakes them within one device budget, and a FastAPI router forwards each request to its
model's engine. Entry point: the ``elastic-kv`` console script (:mod:`elastic_kv_serve.cli`).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

__all__ = ["__version__"]

try:  # the repository's one VERSION file, through the installed distribution's metadata
    __version__ = _version("elastic-kv-serve")
except PackageNotFoundError:  # imported from a source folder that was never installed
    __version__ = "0+unknown"
