"""GPU proof of vllm-elastic-kv on real hardware: runs :func:`benchmarks.gpu_vllm.cli.main` (its module says
what the proof measures, ``--help`` lists the options); each engine's child process runs this script too.

    python3 ci/gpu_vllm.py [--model tiny|1b|8b|gptoss|mla|gdn|moe] [--out DIR] [--cpu-smoke] ...
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_vllm.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
