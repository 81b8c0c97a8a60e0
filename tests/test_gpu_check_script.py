"""scripts/gpu_check.py runs its CPU-safe parts here; CUDA-only checks report themselves skipped."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_cpu_parts(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--device", "cpu",
                           "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = json.load(open(out))["checks"]
    assert checks["overlap_parity"]["ok"] and checks["overlap_parity"]["tokens_equal"]
    assert checks["throughput_vs_hf"]["ok"]
    assert checks["lora"]["ok"], checks["lora"]
    for name in ("paged_decode_kernel", "graph_vs_eager", "nccl_tp1", "cuda_graph_speedup",
                 "inplace_update_no_recapture", "release_resume_memory", "verl_cuda_ipc_handles"):
        assert checks[name]["skipped"] == "needs CUDA"
