"""``python -m elastic_kv_serve`` = ``elastic-kv``."""

import sys

from elastic_kv_serve.cli import main

sys.exit(main())
