"""Rollout throughput vs Hugging Face generate. Same as ``rollout bench throughput``."""

import os
import sys

# Run as a script, this folder comes first on sys.path, where weight_sync.py (the benchmark) would
# shadow the weight_sync package: put the repository root first instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from rollout.tools.bench_throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
