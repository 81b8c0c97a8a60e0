"""Run under torchrun (2 ranks): ZeRO-3 buckets gathered straight from the partitions equal those
gathered by DeepSpeed's GatheredParameters, bit for bit, in fp32 and cast to bf16, across pushes."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer_bridge.ds_setup import ds_config, setup_deepspeed_env  # noqa: E402


def main(model_path: str) -> None:
    setup_deepspeed_env()
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge.push import PushStats, _partitioned, gathered_buckets, param_buckets
    from weight_sync.bucket import BucketPool

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ds_config(3, 0.1, False, 2))
    module = engine.module
    odd = [p for _, p in module.named_parameters() if p.ds_numel % 2]
    assert odd, "the model should have a parameter whose size does not split evenly"
    assert all(_partitioned(b) is not None for b in param_buckets(module, torch.float32, 4096))
    pool = BucketPool()
    for dtype in (torch.float32, torch.bfloat16, torch.float32):  # the pool's buffers reused, grown, reused
        direct = [t for b in gathered_buckets(module, dtype, 4096, PushStats(), pool=pool) for t in b]
        want = [t for b in gathered_buckets(module, dtype, 4096, PushStats(), direct=False) for t in b]
        assert [n for n, _ in direct] == [n for n, _ in want]
        for (n, a), (_, b) in zip(direct, want):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape and torch.equal(a, b), n
    print("GATHER_OK", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # torn down here, not by the interpreter's exit


if __name__ == "__main__":
    main(sys.argv[1])
