"""Rollout throughput vs Hugging Face generate. Same as ``rollout bench throughput``."""

from rollout.bench_throughput import main

if __name__ == "__main__":
    main()
