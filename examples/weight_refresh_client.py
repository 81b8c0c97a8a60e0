"""Refresh a running rollout server's weights, the way a trainer does, and show that it took.

    rollout serve --model-path A --port 30000 --admin-api-key "$ADMIN" &
    python examples/weight_refresh_client.py --url http://127.0.0.1:30000 --admin-api-key "$ADMIN" \\
        --weights B --via distributed        # or --via disk (B must be readable by the server)

It generates once, pushes the weights of folder B (``distributed``: this process loads B with
``transformers`` and broadcasts it over a weight-update group the server joins, in buckets, one
all-or-nothing transaction; ``disk``: the server reads B itself), checks a weight read back from
the server against B, and generates again: the outputs now carry the new version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"))
    ap.add_argument("--admin-api-key", default=os.environ.get("ROLLOUT_ADMIN_API_KEY"))
    ap.add_argument("--weights", required=True, help="a Hugging Face folder with the new weights")
    ap.add_argument("--via", choices=["distributed", "disk"], default="distributed")
    ap.add_argument("--version", default="refreshed")
    ap.add_argument("--prompt", default="The weights are")
    args = ap.parse_args(argv)

    import torch
    from safetensors import safe_open

    from rollout.server import RolloutClient
    from trainer_bridge import push_weights
    from trainer_bridge.distributed_target import DistributedTarget

    client = RolloutClient(args.url, api_key=args.api_key, admin_api_key=args.admin_api_key)
    client.wait_ready(60)
    greedy = {"max_new_tokens": 12, "temperature": 0}
    before = client.generate(prompts=args.prompt, sampling_params=greedy)[0]
    print(f"before: version={before.weight_version!r} text={before.text!r}")

    if args.via == "disk":
        result = client.update_weights_from_disk(args.weights, weight_version=args.version)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
        target = DistributedTarget(client)  # the server's ranks join our weight-update group
        result = push_weights(model, target, version=args.version).result  # buckets -> one transaction
        target.close()
    print(f"refresh via {args.via}: success={result.success} {result.message!r} in {result.seconds:.3f}s")
    if not result.success:
        return 1

    name = "model.norm.weight"
    files = [f for f in os.listdir(args.weights) if f.endswith(".safetensors")]
    with safe_open(os.path.join(args.weights, files[0]), framework="pt") as f:
        expected = f.get_tensor(name)[:4].float().tolist() if name in f.keys() else None
    got = client.get_weights_by_name(name, 4)
    after = client.generate(prompts=args.prompt, sampling_params=greedy)[0]
    summary = {"version": client.get_weight_version(), "read_back_matches": expected is None or got == expected,
               "after_version": after.weight_version, "after_text": after.text,
               "outputs_changed": after.output_token_ids != before.output_token_ids}
    print(json.dumps(summary))
    return 0 if summary["read_back_matches"] and summary["version"] == args.version else 1


if __name__ == "__main__":
    sys.exit(main())
