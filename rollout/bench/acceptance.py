"""``rollout bench acceptance``: how many guesses the suffix drafter (``rollout.speculative.drafter``)
gets right on real rollouts, before any verify step exists — the bound on what exact speculation can
give on a workload.

Exact speculation accepts a guess only where it equals the token plain decoding draws there, so the
tokens it produces are plain decoding's, and its acceptance can be replayed from plain decoding's
outputs: each verify step of a sequence proposes up to ``k`` tokens from what the drafter holds, takes
the longest prefix equal to the sequence's next tokens, and advances by that many plus one (the token
drawn where the guess failed, or after the last guess). Sequences advance in lockstep rounds (one verify
forward each), each round seeing its siblings' text so far.

Two epochs of the same prompts (by default a smaller ``grpo-short``: 16 chat prompts x n=8, 128 new tokens,
temperature 1, top-k and top-p off): epoch 1 fills the drafter with
its finished rollouts; between the epochs the weights take one real training step (``--train on``: a
policy-gradient step with Adam on a group-normalised reward over some of epoch 1's samples, in fp32
with ``transformers``, pushed with ``update_weights_from_tensor``); epoch 2 draws with seeds disjoint
from epoch 1's. Reported for epoch 2, per source of guesses — earlier rollouts, siblings, the sequence's
own text, all of them, and all of them as a tree of 32 guesses per step (a draw accepted if any branch
has it): accepted tokens per verify step, rounds against plain decoding's steps for the whole rollout
and for its long tail (the rounds once fewer than a quarter of the sequences are left), and what the
drafter holds; and the mode rate — the share of drawn tokens that were the most likely one, the
acceptance per position of a guesser that knew each distribution but not the draw. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from rollout.bench.common import add_model_flags, add_output_flags, build_model, machine, model_label, write_result
from rollout.speculative.drafter import SuffixDrafter

SOURCES = ("rollouts", "siblings", "own", "all", "all-tree")
TREE_NODES = 32  # the guesses per step of the ``all-tree`` source (as many verify rows)


@dataclass
class Seq:
    prompt: int  # index of its prompt
    prompt_ids: list[int]
    output: list[int]
    modes: int = 0  # how many of its tokens were the most likely one where drawn


def replay(seqs: list[Seq], drafter: SuffixDrafter, k: int, live: bool, own_only: bool = False,
           tree_nodes: int = 0) -> dict:
    """Lockstep verify rounds over ``seqs`` with guesses from ``drafter`` (what it was given before, and
    with ``live`` the sequences' text so far, added round by round: each sequence's own and its
    siblings', or with ``own_only`` its own alone); with ``tree_nodes`` a tree of that many guesses per
    step (``propose_tree``), a draw accepted where any branch guessed it."""
    def key(i: int):
        return ("own", i) if own_only else seqs[i].prompt

    pos = [0] * len(seqs)
    steps, accepted, rounds, tail_rounds, plain_tail = 0, 0, 0, 0, None
    left = len(seqs)
    while left:
        rounds += 1
        if left < len(seqs) / 4:
            tail_rounds += 1
            if plain_tail is None:  # plain decoding's tail from the same point: the longest remaining output
                plain_tail = max(len(s.output) - p for s, p in zip(seqs, pos) if p < len(s.output))
        if live:
            for i, s in enumerate(seqs):
                if pos[i] < len(s.output):
                    drafter.update_live(key(i), i, len(s.prompt_ids), s.prompt_ids + s.output[:pos[i]])
        for i, s in enumerate(seqs):
            if pos[i] >= len(s.output):
                continue
            ctx, depth = s.prompt_ids + s.output[:pos[i]], min(k, len(s.output) - pos[i] - 1)
            n = _accepted_in_tree(drafter.propose_tree(key(i), ctx, depth, tree_nodes), s.output[pos[i]:]) \
                if tree_nodes else _accepted(drafter.propose(key(i), ctx, depth).tokens, s.output[pos[i]:])
            accepted += n
            pos[i] += n + 1
            steps += 1
            if pos[i] >= len(s.output):
                left -= 1
                drafter.finish_live(i, keep=False)
    tokens = sum(len(s.output) for s in seqs)
    plain_rounds = max(len(s.output) for s in seqs)
    return {"tokens": tokens, "verify_steps": steps, "accepted": accepted, "tokens_per_step": tokens / max(1, steps),
            "rounds": rounds, "plain_rounds": plain_rounds, "rounds_speedup": plain_rounds / rounds,
            "tail_rounds": tail_rounds, "plain_tail_rounds": plain_tail or 0,
            "tail_speedup": plain_tail / tail_rounds if tail_rounds and plain_tail else None}


def _accepted(guesses: list[int], drawn: list[int]) -> int:
    n = 0
    while n < len(guesses) and guesses[n] == drawn[n]:
        n += 1
    return n


def _accepted_in_tree(nodes, drawn: list[int]) -> int:
    at, n = -1, 0
    while n < len(drawn):
        child = next((j for j, node in enumerate(nodes) if node.parent == at and node.token == drawn[n]), None)
        if child is None:
            break
        at, n = child, n + 1
    return n


def _train_step(path: str, seqs: list[Seq], n: int, lr: float) -> list[tuple[str, torch.Tensor]]:
    """One policy-gradient step (Adam, fp32) on a group-normalised reward — shorter answers score
    higher — over the first two groups of ``seqs``; returns the new weights by their Hugging Face names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batch = seqs[: 2 * n]
    lengths = torch.tensor([float(len(s.output)) for s in batch]).view(-1, n)
    adv = (-(lengths - lengths.mean(1, keepdim=True)) / (lengths.std(1, keepdim=True) + 1e-6)).flatten()
    loss = torch.zeros(())
    for s, a in zip(batch, adv.tolist()):
        ids = torch.tensor([s.prompt_ids + s.output])
        logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.output).unsqueeze(1)).sum()
        loss = loss - a * lp / len(batch)
    loss.backward()
    opt.step()
    return [(name, p.detach()) for name, p in model.named_parameters()]


def _generate(engine, prompts: list[list[int]], n: int, max_new: int, seed: int, temperature: float) -> list[Seq]:
    from rollout import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=-1, top_p=1.0, n=n, seed=seed)
    outs = engine.generate(input_ids=prompts, sampling_params=sp, top_logprobs_num=1)
    return [Seq(o.prompt_index, prompts[o.prompt_index], list(o.output_token_ids),
                sum(t == top[0][0] for t, top in zip(o.output_token_ids, o.output_top_logprobs)))
            for o in outs]


def run(args) -> dict:
    from transformers import AutoTokenizer

    from rollout import RolloutEngine
    from rollout.bench.throughput import make_prompts
    from rollout.engine.engine import run_on_own_thread

    path = build_model(args.model, args.workdir)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), args.num_prompts)
    kv = len(prompts) * args.n * (max(map(len, prompts)) + args.max_new_tokens + 32)
    with RolloutEngine(path, dtype=args.dtype, kv_cache_tokens=kv, use_generation_config=False) as engine:
        epoch1 = _generate(engine, prompts, args.n, args.max_new_tokens, 0, args.temperature)
        if args.train == "on":
            new = run_on_own_thread(lambda: _train_step(path, epoch1, args.n, args.lr))
            dtype = engine.dtype
            res = engine.update_weights_from_tensor([(n, t.to(dtype)) for n, t in new], weight_version="step-1")
            if not res.success:
                raise RuntimeError(f"weight update failed: {res.message}")
        epoch2 = _generate(engine, prompts, args.n, args.max_new_tokens, 1_000_003, args.temperature)  # disjoint seeds
    result = {"benchmark": "acceptance", "machine": machine(),
              "config": {"model": model_label(args.model), "dtype": args.dtype, "num_prompts": args.num_prompts,
                         "n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "k": args.k, "train": args.train,
                         "lr": args.lr, "max_match": args.max_match, "min_match": args.min_match,
                         "min_confidence": args.min_confidence},
              "epoch2_same_as_epoch1": sum(a.output == b.output for a, b in zip(epoch1, epoch2)),
              "output_len_mean": statistics.fmean(len(s.output) for s in epoch2),
              # the bound for any guesser that cannot see the draw's randomness: guessing the most likely
              # token is accepted where the draw is that token
              "mode_rate": sum(s.modes for s in epoch2) / max(1, sum(len(s.output) for s in epoch2)),
              "sources": {}}
    for source in SOURCES:
        d = SuffixDrafter(max_match=args.max_match, min_match=args.min_match, min_confidence=args.min_confidence)
        if source in ("rollouts", "all", "all-tree"):
            for q in epoch1:
                d.add_finished(q.prompt, len(q.prompt_ids), q.prompt_ids + q.output, version="epoch-1")
        res = replay(epoch2, d, args.k, live=source != "rollouts", own_only=source == "own",
                     tree_nodes=TREE_NODES if source == "all-tree" else 0)
        res["drafter_tokens"] = d.num_tokens
        result["sources"][source] = res
    print({s: round(r["tokens_per_step"], 2) for s, r in result["sources"].items()})
    temp = "" if args.temperature == 1.0 else f"_t{args.temperature:g}"
    write_result(result, args.out_dir, f"acceptance_{model_label(args.model)}_{args.dtype}_k{args.k}"
                                       f"_train-{args.train}{temp}", plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    from rollout.bench.common import save_figure

    src = result["sources"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    bars = a.bar(list(src), [src[s]["tokens_per_step"] for s in src])
    a.bar_label(bars, fmt="%.2f", fontsize=8)
    a.set_ylabel("tokens per verify step")
    cfg = result["config"]
    a.set_title(f"{cfg['model']} {cfg['dtype']}, epoch 2 ({cfg['num_prompts']} prompts x n={cfg['n']}, "
                f"T={cfg['temperature']:g}), k={cfg['k']}, train {cfg['train']}; mode rate "
                f"{result['mode_rate']:.2f}", fontsize=8)
    x = range(len(src))
    b.bar([i - 0.2 for i in x], [src[s]["rounds_speedup"] for s in src], width=0.4, label="whole rollout")
    b.bar([i + 0.2 for i in x], [src[s]["tail_speedup"] or 0.0 for s in src], width=0.4, label="long tail")
    b.set_xticks(list(x), list(src))
    b.axhline(1.0, ls="--", lw=0.8, color="gray")
    b.set_ylabel("plain steps / verify rounds")
    save_figure(fig, path, legend_ax=b)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="the most tokens guessed per verify step")
    ap.add_argument("--temperature", type=float, default=1.0, help="the workload's (grpo-short: 1.0)")
    ap.add_argument("--train", choices=["on", "off"], default="on", help="a real training step between the epochs")
    ap.add_argument("--lr", type=float, default=1e-5, help="the training step's Adam learning rate")
    ap.add_argument("--max-match", type=int, default=16)
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--min-confidence", type=float, default=0.2)
    add_output_flags(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
