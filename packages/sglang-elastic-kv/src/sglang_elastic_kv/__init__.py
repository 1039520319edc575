"""sglang-elastic-kv: an elastic KV cache for SGLang (``--kv-cache-backend=elastic``).

Modules, bottom to top: :mod:`.config` (the one place the environment is read), :mod:`.compat` (the
SGLang versions served and the hook targets for each), :mod:`.backing` (spaces, geometry, data plane
and ledger of one pool), :mod:`.pool` and :mod:`.allocators` (SGLang's classes, subclassed),
:mod:`.hooks` (what an enabled plugin registers), :mod:`.cli` (the command-line flag) and
:mod:`.plugin` (the ``sglang.srt.plugins`` entry point). Importing this package imports no SGLang code.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:  # the repository's one VERSION file, through the installed distribution's metadata
    __version__ = _version("sglang-elastic-kv")
except PackageNotFoundError:  # imported from a source folder that was never installed
    __version__ = "0+unknown"
