"""Speculative decoding's parts that need no engine: the suffix drafter (``rollout.speculative.drafter``)."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import SamplingParams
from rollout.speculative.drafter import SuffixDrafter

PROMPT = [101, 102, 103, 104]


def test_an_earlier_rollout_of_the_prompt_is_proposed_from_where_the_context_matches_it():
    d = SuffixDrafter(max_match=8, min_match=2)
    d.add_finished("p", len(PROMPT), PROMPT + [5, 6, 7, 8, 9, 10, 11], version="v1")
    # a new sample of the same prompt that has reached "6 7"
    p = d.propose("p", PROMPT + [5, 6, 7], k=3)
    assert p.tokens == [8, 9, 10] and p.confidences == [1.0, 1.0, 1.0]
    assert p.match_len == 7 and p.num_occurrences == 1  # back through the prompt's tail
    # the start of an output: matched on the prompt's last tokens
    assert d.propose("p", PROMPT, k=2).tokens == [5, 6]
    assert d.propose("p", PROMPT + [5, 6, 7, 8, 9, 10, 11], k=4).tokens == []  # nothing stored past it
    assert d.propose("other", PROMPT + [5, 6, 7], k=3).tokens == []  # another prompt's rollouts are not used
    assert d.propose("p", PROMPT + [5, 6, 99], k=3).tokens == []  # no occurrence of "6 99"
    assert d.propose("p", PROMPT + [5, 6, 7], k=0).tokens == []


def test_diverging_rollouts_give_the_majority_path_with_its_share_and_stop_below_the_floor():
    d = SuffixDrafter(max_match=4, min_match=2, min_confidence=0.5)
    for out in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 8], [1, 2, 9, 9, 9]):
        d.add_finished("p", len(PROMPT), PROMPT + out)
    p = d.propose("p", PROMPT + [1, 2], k=4)
    # after "1 2": 3 (3 of 4), then 4 (2 of 4), then 5 or 6 (1 of 4 each: under the floor)
    assert p.tokens == [3, 4] and p.confidences == [0.75, 0.5]
    # the longest match wins over shorter ones: "2 3 7" occurred once, after a longer run
    assert d.propose("p", PROMPT + [1, 2, 3, 7], k=1).tokens == [8]


def test_siblings_in_flight_and_a_sequence_s_own_text_are_proposed_as_they_grow():
    d = SuffixDrafter(max_match=6, min_match=2)
    a = PROMPT + [7, 8, 9, 10, 11, 12]
    d.update_live("p", 1, len(PROMPT), a[:6])
    d.update_live("p", 1, len(PROMPT), a)  # grown by four tokens
    assert d.propose("p", PROMPT + [7, 8], k=3).tokens == [9, 10, 11]  # a sibling's text
    # a sequence that repeats itself: its own earlier cycle
    loop = PROMPT + [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]
    d.update_live("q", 2, len(PROMPT), loop)
    assert d.propose("q", loop, k=4).tokens == [42, 43, 40, 41]
    # finished and kept: proposed to the next sample of the prompt; dropped: gone
    d.finish_live(1, keep=True, version="v2")
    assert d.num_rollouts("p") == 1 and d.propose("p", PROMPT + [7, 8], k=1).tokens == [9]
    d.finish_live(2, keep=False)
    assert d.propose("q", loop, k=4).tokens == [] and d.num_rollouts("q") == 0


def test_memory_is_bounded_by_rollouts_per_prompt_and_by_tokens_least_recently_used_first():
    d = SuffixDrafter(max_match=4, min_match=2, max_rollouts_per_prompt=2, max_tokens=60)
    for i in range(3):
        d.add_finished("p", len(PROMPT), PROMPT + [i, 50 + i, 60 + i])
    assert d.num_rollouts("p") == 2  # the oldest went
    assert d.propose("p", PROMPT + [0, 50], k=1).tokens == []
    assert d.propose("p", PROMPT + [2, 52], k=1).tokens == [62]
    held = d.num_tokens
    for prompt in ("q", "r", "s", "t", "u", "v", "w", "x", "y"):
        d.propose("p", PROMPT + [2, 52], k=1)  # "p" stays recently used
        d.add_finished(prompt, len(PROMPT), PROMPT + [1, 2, 3])
        assert d.num_tokens <= 60
    assert d.num_rollouts("q") == 0 and d.num_rollouts("p") == 2 and held <= 60
    # a rule on versions: rollouts of other weights dropped
    d.add_finished("z", len(PROMPT), PROMPT + [9, 9], version="old")
    d.add_finished("z", len(PROMPT), PROMPT + [8, 8], version="new")
    assert d.drop_finished(lambda v: v != "old") >= 1 and d.num_rollouts("z") == 1
    d.drop_finished()
    assert d.num_prompts == 0 and d.num_tokens == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_match"):
        SuffixDrafter(max_match=2, min_match=3)
    with pytest.raises(ValueError, match="share"):
        SuffixDrafter(min_confidence=1.5)
    from rollout.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_policy"):
        EngineConfig.from_kwargs("x", speculative_policy="sometimes")
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def _longest_matches(docs: list[list[int]], context: list[int], min_match: int, max_match: int):
    """By brute force: the longest backward match of ``context``'s end at any position with a
    continuation, and every occurrence of that length."""
    occ, best = [], 0
    for toks in docs:
        for e in range(min_match, len(toks)):
            n = 0
            while n < min(max_match, e, len(context)) and toks[e - 1 - n] == context[len(context) - 1 - n]:
                n += 1
            if n >= min_match and n > best:
                best, occ = n, [(toks, e)]
            elif n >= min_match and n == best:
                occ.append((toks, e))
    return best, occ


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=5),
       st.lists(st.integers(0, 3), min_size=2, max_size=12), st.integers(1, 5), st.booleans())
def test_proposals_equal_a_brute_force_longest_match(outputs, tail, k, churn):
    """On small alphabets (many repeats, many ties): the match length, the share of each guess, that each
    guess is one of the most common continuations, and where the proposal stops equal a brute-force
    search; and so after rollouts were dropped and the index rebuilt."""
    floor = 0.25
    d = SuffixDrafter(max_match=5, min_match=2, max_rollouts_per_prompt=3, min_confidence=floor, max_scan=10_000)
    added = ([[i % 4] * 30 for i in range(40)] if churn else []) + outputs  # churn: dead entries, rebuilds
    for out in added:
        d.add_finished("p", len(PROMPT), PROMPT + out)
    context = PROMPT + tail
    got = d.propose("p", context, k)
    best, occ = _longest_matches([PROMPT + out for out in added[-3:]], context, 2, 5)
    if not occ:
        assert got.tokens == [] and got.match_len == 0
        return
    assert got.match_len == best and got.num_occurrences == len(occ)
    total = len(occ)
    for step in range(k + 1):
        counts = Counter(t[e + step] for t, e in occ if e + step < len(t))
        top = max(counts.values(), default=0)
        if step == len(got.tokens):  # the drafter stopped: k reached, nothing follows, or under the floor
            assert step == k or top == 0 or top / total < floor
            break
        token = got.tokens[step]
        assert counts[token] == top and got.confidences[step] == pytest.approx(top / total)
        occ = [(t, e) for t, e in occ if e + step < len(t) and t[e + step] == token]


def test_replayed_acceptance_counts_only_guesses_equal_to_the_tokens_drawn():
    """``rollout bench acceptance``'s replay: a second epoch that repeats the first is guessed whole (k
    guesses accepted per verify step, plus the drawn token); one that shares nothing gains nothing; a
    sequence that repeats itself is guessed from its own text."""
    from rollout.bench.acceptance import Seq, replay

    out = list(range(200, 220))
    first = [Seq(0, PROMPT, out)]
    d = SuffixDrafter()
    d.add_finished(0, len(PROMPT), PROMPT + out)
    same = replay([Seq(0, PROMPT, out)], d, k=4, live=False)
    assert same["verify_steps"] == 4 and same["tokens_per_step"] == 5.0 and same["accepted"] == 16
    other = replay([Seq(0, PROMPT, list(range(300, 320)))], d, k=4, live=False)
    assert other["verify_steps"] == 20 and other["accepted"] == 0
    loop = [Seq(1, PROMPT, [7, 8, 9] * 10)]
    alone = replay(loop, SuffixDrafter(), k=4, live=True, own_only=True)
    assert alone["accepted"] > 15 and first[0].output == out


def test_verify_rows_are_decode_rows_and_only_returned_guesses_count_as_accepted():
    """The Speculator's part of a step: a sequence's last token and its guesses become decode rows over one
    block-table snapshot, each at its own position and sampled as plain decoding would sample it; the draws
    are taken up to the first that differs from its guess, and a stop ends the taking (the guesses after it
    are not counted as accepted)."""
    from types import SimpleNamespace

    from rollout.speculative.verify import Speculator

    spec = Speculator(max_draft_tokens=3, max_batch=8)
    req = SimpleNamespace(lora=None, top_logprobs_num=0, return_sampling_mask=False)
    seq = SimpleNamespace(seq_id=1, req=req, params=SamplingParams(), seed=5, token_ids=[1, 2, 3, 4],
                          num_prompt_tokens=3, block_table=[10, 11], spec_guesses=[5, 6, 7], num_computed_tokens=3,
                          spec_verify_ct=0, spec_draft_token_num=0, spec_accept_token_num=0)
    rows = ([], [], [], [], [])
    logits_rows, sample_idx, samplers, verifies = [], [], [], []
    nxt = spec.add_verify_rows(seq, 3, 4, rows, logits_rows, sample_idx, samplers, verifies, row=2)
    input_ids, tables, lora_slots, ctx_lens, q_lens = rows
    assert nxt == 6 and input_ids == [4, 5, 6, 7] and ctx_lens == [4, 5, 6, 7] and q_lens == [1] * 4
    assert tables == [[10, 11]] * 4 and tables[0] is not seq.block_table and lora_slots == [-1] * 4
    assert logits_rows == [2, 3, 4, 5] and sample_idx == [0, 1, 2, 3] and seq.num_computed_tokens == 7
    assert [v.token_ids for v in samplers] == [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6],
                                               [1, 2, 3, 4, 5, 6, 7]]
    assert verifies == [(seq, 0, [5, 6, 7])]
    taken = []

    def append(s, row):  # the scheduler's: the row's token onto the sequence; a stop at token 6
        s.token_ids.append([5, 6, 9, 9][row])
        taken.append(row)
        return s.token_ids[-1] != 6

    spec.take_verified(seq, 0, [5, 6, 7], [5, 6, 9, 9], append)
    assert taken == [0, 1] and seq.token_ids == [1, 2, 3, 4, 5, 6]  # stopped at 6: nothing after it
    assert seq.spec_draft_token_num == 3 and seq.spec_accept_token_num == 2 and spec.num_accepted_tokens == 2
    assert seq.num_computed_tokens == 5  # KV valid up to the input of the last row taken


def test_the_acceptance_benchmark_writes_its_numbers_and_plot(tmp_path):
    from rollout.bench import acceptance

    res = acceptance.main(["--model", "tiny", "--num-prompts", "2", "--n", "2", "--max-new-tokens", "12",
                           "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path)])
    assert set(res["sources"]) == {"rollouts", "siblings", "own", "all", "all-tree"} and res["config"]["train"] == "on"
    for r in res["sources"].values():
        assert 0 < r["tokens"] <= 2 * 2 * 12 and r["tokens"] / 9 <= r["verify_steps"] <= r["tokens"]
    assert (tmp_path / "acceptance_tiny_bfloat16_k8_train-on.png").exists()


def test_the_speculation_benchmark_compares_on_and_off_on_one_engine(tmp_path):
    """``rollout bench speculation`` on a tiny model: epoch 2 on and off with the very same tokens (fp32), a
    verify step only when on; batch 1 on a repeated prompt, greedy guessed from its first run."""
    from rollout.bench import speculation

    res = speculation.main(["--model", "tiny", "--dtype", "float32", "--num-prompts", "2", "--n", "2",
                            "--max-new-tokens", "12", "--batch1-tokens", "16", "--workdir", str(tmp_path / "models"),
                            "--out-dir", str(tmp_path)])
    e, b = res["epochs"], res["batch1"]
    assert e["epoch2_same_tokens"] == 1.0 and e["epoch2_off"]["spec_verify_ct"] == 0
    assert e["epoch2_on"]["samples"] == e["epoch2_off"]["samples"] == 4 and e["rollout_speedup"] > 0
    assert b["greedy"]["same_tokens"] and b["t1_new_seed"]["same_tokens"] and b["greedy"]["off"]["spec_verify_ct"] == 0
    assert b["greedy"]["on"]["spec_accept_token_num"] >= 8  # the first run's tokens, guessed again
    assert (tmp_path / "speculation_grpo-short_tiny_float32_k4.png").exists()


def test_a_tree_of_guesses_holds_every_branch_with_its_share_parents_first():
    d = SuffixDrafter(max_match=4, min_match=2, min_confidence=0.2)
    for out in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 2, 6, 7], [1, 2, 9, 9]):
        d.add_finished("p", len(PROMPT), PROMPT + out)
    nodes = d.propose_tree("p", PROMPT + [1, 2], k=2, max_nodes=8)
    got = {(n.depth, n.token, nodes[n.parent].token if n.parent >= 0 else None): n.share for n in nodes}
    # depth 0: 3 (2/5), 6 (2/5), 9 (1/5); depth 1: after 3 -> 4, 5 (1/5 each), after 6 -> 7 (2/5), after 9 -> 9
    assert got == {(0, 3, None): 0.4, (0, 6, None): 0.4, (0, 9, None): 0.2, (1, 7, 6): 0.4, (1, 4, 3): 0.2,
                   (1, 5, 3): 0.2, (1, 9, 9): 0.2}
    assert all(n.parent < i for i, n in enumerate(nodes))
    assert len(d.propose_tree("p", PROMPT + [1, 2], k=2, max_nodes=3)) == 3  # the largest shares kept
    from rollout.bench.acceptance import _accepted_in_tree

    assert _accepted_in_tree(nodes, [6, 7, 8]) == 2 and _accepted_in_tree(nodes, [3, 5]) == 2
    assert _accepted_in_tree(nodes, [4]) == 0


def test_the_policy_guesses_only_as_much_as_the_measured_step_costs_pay_for():
    """``worth``: guesses join a step only while the tokens they are expected to add raise the step's
    tokens per second by the measured cost of its rows — all of them where a step costs the same at every
    row count, none where rows cost their full share, some in between; a row count never measured is
    tried. A count's cost is the least of its recent steps, and counts only from its third step.
    ``gains``: the drafter's confidences, calibrated by how guesses have done."""
    from rollout.speculative.verify import Speculator, StepCosts, gains, worth

    costs = StepCosts()
    for rows, seconds in [(1, 10.0), (4, 10.0), (8, 16.0), (16, 32.0)] * 3:
        costs.observe(rows, seconds)
    costs.observe(16, 42.0)  # a slower step (something else ran): the least stands
    costs.observe(3, 1.0)  # one step at 3 rows: not settled, not used
    assert [costs.at(r) for r in (1, 2, 3, 6, 12, 16, 17)] == [10.0, 10.0, 10.0, 13.0, 24.0, 32.0, None]
    assert gains(0.5, [1.0, 0.8, 0.2]) == [0.5, 0.9, 1.0] and gains(2.0, [0.9, 0.3]) == [1.0, 1.6]
    assert worth(costs, 1, 1, [0.5, 0.75, 0.875]) == 3  # flat from 1 to 4 rows: every guess pays
    assert worth(costs, 8, 8, [0.95, 1.9, 2.85, 3.8]) == 0  # 1.5 s a row past 8: 8 tokens at 16 s beat 8.95 at 17.5
    assert worth(costs, 4, 4, gains(1.0, [0.9, 0.81, 0.729, 0.6561])) == 3  # 10 s at 4 rows, then 1.5 s a row
    assert worth(costs, 16, 16, [0.1, 0.2]) == 2  # 17 rows never ran: tried
    steep = StepCosts()
    for rows, seconds in [(2, 10.0), (3, 10.0), (4, 14.0)] * 3:
        steep.observe(rows, seconds)
    assert worth(steep, 2, 2, [0.5]) == 1 and worth(steep, 3, 2.5, [0.5]) == 0  # the step's guesses so far count
    # the speculator: no step opens above max_batch, or where even certain guesses of the best record so far
    # could not pay for their rows; a temperature whose guesses fail keeps its sequences from guessing
    spec = Speculator(4, 8)
    spec.costs = costs
    assert spec.may_pay(1) and not spec.may_pay(9)
    spec.costs = StepCosts()
    for rows, seconds in [(2, 10.0), (3, 10.0), (4, 11.0), (8, 40.0)] * 3:  # a fourth row costs 10 %
        spec.costs.observe(rows, seconds)
    assert spec.may_pay(3) and spec.ratio(1, 1.0) == 1.0  # nothing measured: the drafter at its word
    for i in range(20):
        spec._given[i] = ([0.9, 0.6], 1.0)
        spec.accepted(i, [5, 6], [7, 7])  # rejected at temperature 1
    assert spec.ratio(99, 1.0) < 0.1 and spec.ratio(99, 0.0) == 1.0 and not spec.may_pay(3)
    spec._given[100] = ([1.0, 1.0], 0.0)
    spec.accepted(100, [5, 6], [5, 6])  # greedy, both right
    assert spec.may_pay(3)


SETTINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0),
    "top-k-p-min-p": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
    "penalties": dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    "stops-n": dict(temperature=1.0, n=3, min_new_tokens=4, stop_token_ids=[7, 11, 13]),
}


def _run(engine, prompts, setting: str, seed: int):
    sp = SamplingParams(max_new_tokens=24, seed=seed, **SETTINGS[setting])
    outs = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    return [(o.output_token_ids, o.output_logprobs, o.output_top_logprobs, o.finish_reason) for o in outs]


def _same(plain, spec):
    for (t1, lp1, top1, f1), (t2, lp2, top2, f2) in zip(plain, spec):
        assert t1 == t2 and f1 == f2
        assert max((abs(a - b) for a, b in zip(lp1, lp2)), default=0.0) < 1e-4
        assert [[i for i, _ in row] for row in top1] == [[i for i, _ in row] for row in top2]


@pytest.fixture(scope="module")
def spec_engines(llama_path):
    from rollout import RolloutEngine

    kw = dict(dtype="float32", kv_cache_tokens=2048, use_generation_config=False)
    with RolloutEngine(llama_path, **kw) as plain, \
            RolloutEngine(llama_path, speculative_num_draft_tokens=4, speculative_policy="always", **kw) as spec:
        yield plain, spec


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculation_gives_plain_decoding_s_tokens_and_logprobs(spec_engines, setting):
    """fp32: a first epoch, the same prompts and seeds again (the drafter holds the first epoch's text:
    long runs of guesses accepted), and new seeds (guesses mostly rejected) give plain decoding's tokens,
    finish reasons and top logprobs, logprobs within 1e-4, with guesses accepted."""
    plain, spec = spec_engines
    prompts = [[5, 9, 23, 41, 7], [3, 3, 8, 100, 64, 2, 17], [44, 45, 46]]
    before = spec.get_stats()
    for seed in (11, 11, 12):
        _same(_run(plain, prompts, setting, seed), _run(spec, prompts, setting, seed))
    stats = spec.get_stats()
    assert stats["spec_verify_ct"] > before["spec_verify_ct"]
    assert stats["spec_accept_token_num"] - before["spec_accept_token_num"] >= 10


def test_tokens_equal_plain_decoding_over_many_seeds(spec_engines):
    """Twelve seeds, each drawn twice (the second time most guesses are right, the first time most are
    wrong: both kinds of verify step, at every position of the run), temperature 1 with top-k, n=2: the
    speculating engine's tokens are plain decoding's every time."""
    plain, spec = spec_engines
    prompts = [[5, 9, 23, 41, 7], [44, 45, 46, 47]]
    before = spec.get_stats()
    for seed in range(100, 112):
        sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=30, n=2, seed=seed)
        want = [o.output_token_ids for o in plain.generate(input_ids=prompts, sampling_params=sp)]
        for _ in range(2):
            assert [o.output_token_ids for o in spec.generate(input_ids=prompts, sampling_params=sp)] == want, seed
    stats = spec.get_stats()
    accepted = stats["spec_accept_token_num"] - before["spec_accept_token_num"]
    rejected = stats["spec_draft_token_num"] - before["spec_draft_token_num"] - accepted
    assert accepted >= 100 and rejected >= 20, (accepted, rejected)


def test_a_verifier_that_accepts_guesses_without_drawing_gives_other_tokens(spec_engines, monkeypatch):
    """The check above can fail: accepting every guess (no draw compared) changes the tokens."""
    from rollout.speculative.verify import Speculator

    plain, spec = spec_engines
    prompts = [[5, 9, 23, 41, 7], [3, 3, 8, 100, 64, 2, 17]]
    _run(spec, prompts, "sampled", 21)  # the drafter holds this seed's text
    monkeypatch.setattr(Speculator, "accepted", lambda self, seq_id, guesses, drawn: len(guesses))
    assert [o[0] for o in _run(plain, prompts, "sampled", 22)] != [o[0] for o in _run(spec, prompts, "sampled", 22)]


@pytest.mark.parametrize("extra", [dict(tp_size=2), dict(deterministic=True), dict(deterministic=True, dtype="bfloat16"),
                                   dict(enable_overlap=True)],
                         ids=["tp2", "batch-invariant", "batch-invariant-bf16", "overlap"])
def test_speculation_is_exact_at_tp2_and_bitwise_in_the_batch_invariant_mode(llama_path, extra):
    from rollout import RolloutEngine

    kw = dict(dtype="float32", kv_cache_tokens=2048, use_generation_config=False)
    kw.update(extra)
    prompts = [[5, 9, 23, 41, 7], [44, 45, 46]]
    with RolloutEngine(llama_path, **kw) as plain, \
            RolloutEngine(llama_path, speculative_num_draft_tokens=4, speculative_policy="always", **kw) as spec:
        for seed in (3, 3, 4):
            a, b = _run(plain, prompts, "stops-n", seed), _run(spec, prompts, "stops-n", seed)
            if extra.get("deterministic"):
                assert a == b  # tokens, logprobs and top logprobs bit for bit
            else:
                _same(a, b)
        assert spec.get_stats()["spec_accept_token_num"] >= 10


def test_the_server_reports_sglang_s_speculation_fields(make_server, llama_path):
    import httpx

    server = make_server(llama_path, "--dtype", "float32", "--kv-cache-tokens", "1024",
                         "--speculative-num-draft-tokens", "4")
    body = {"input_ids": [5, 9, 23, 41, 7], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                                                "sampling_seed": 9}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        first = http.post("/generate", json=body).json()
        again = http.post("/generate", json=body).json()  # the first answer is now a rollout of the prompt
        assert again["output_ids"] == first["output_ids"]
        meta = again["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        # the first token comes from the prefill, the rest from plain steps or verify steps (and their guesses)
        assert meta["spec_verify_ct"] + meta["spec_accept_token_num"] <= meta["completion_tokens"] - 1
        assert "rollout_spec_accept_token_num" in http.get("/metrics").text
        # the per-request switch: the same tokens, no guesses verified
        off = http.post("/generate", json={**body, "sampling_params": {**body["sampling_params"],
                                                                      "speculative": False}}).json()
        assert off["output_ids"] == first["output_ids"] and off["meta_info"]["spec_verify_ct"] == 0
        bad = http.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], "speculative": 2}})
        assert bad.status_code == 400 and "speculative" in bad.text


def test_speculation_is_exact_with_adapters_in_the_batch_and_across_session_turns(llama_path, tmp_path):
    """Verify chunks run adapter rows (a batch mixing an adapter and the base) and session turns (the
    session's KV kept between turns, rejected positions never counted): plain decoding's tokens."""
    from rollout import RolloutEngine
    from rollout.tools.tiny import make_tiny_adapter

    adapter = make_tiny_adapter(llama_path, str(tmp_path / "adapter"), r=4, seed=1)
    kw = dict(dtype="float32", kv_cache_tokens=2048, use_generation_config=False)
    prompts = [[5, 9, 23, 41, 7], [44, 45, 46]]
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, n=2)
    got = {}
    with RolloutEngine(llama_path, **kw) as plain, \
            RolloutEngine(llama_path, speculative_num_draft_tokens=4, speculative_policy="always", **kw) as spec:
        for name, engine in (("plain", plain), ("spec", spec)):
            assert engine.load_lora_adapter("policy", adapter).success
            runs = []
            for _ in range(2):  # the second run is guessed from the first
                outs = engine.generate(input_ids=prompts, sampling_params=sp, lora_path=["policy", None])
                runs.append([o.output_token_ids for o in outs])
            sid = engine.open_session()
            turns = []
            for turn in ([3, 4, 5], [6, 7], [3, 4, 5]):
                outs = engine.generate(input_ids=[turn], sampling_params=SamplingParams(
                    max_new_tokens=12, temperature=1.0, seed=3), session_id=sid)
                turns.append(outs[0].output_token_ids)
            engine.close_session(sid)
            got[name] = (runs, turns)
        assert got["spec"] == got["plain"]
        assert spec.get_stats()["spec_accept_token_num"] >= 10


def test_a_turn_that_stops_on_a_rejected_guess_keeps_no_kv_of_that_guess(llama_path, monkeypatch):
    """A verify chunk whose draw at the stop position rejects a guess, with guesses after it: the turn ends
    mid-chunk. The session keeps KV only up to the stop token's input (the rejected guess's KV at the stop
    position is never kept, cached or handed to the next turn): the next turn and a later request over the
    same history (no session, no speculation: served from the prefix cache) give plain decoding's tokens
    and logprobs, and the accepted count counts returned tokens only."""
    from rollout import RolloutEngine
    from rollout.speculative.drafter import Proposal, SuffixDrafter

    kw = dict(dtype="float32", kv_cache_tokens=2048, use_generation_config=False)
    prompt, follow = [5, 9, 23, 41, 7, 60, 61, 62, 63, 64], [6, 7, 8]
    greedy = dict(temperature=0.0, max_new_tokens=14)
    with RolloutEngine(llama_path, **kw) as plain, \
            RolloutEngine(llama_path, speculative_num_draft_tokens=4, speculative_policy="always", **kw) as spec:
        free = plain.generate(input_ids=[prompt], sampling_params=SamplingParams(**greedy))[0].output_token_ids
        stop_at = next(k for k in range(4, len(free)) if free[k] not in free[:k])  # a token seen once, not first
        stop = free[stop_at]
        wrong = (stop + 1) % 50 + 3

        def oracle(self, key, context, k):
            """Plain decoding's tokens, but a wrong guess at the stop position (and guesses after it)."""
            at = len(context) - len(prompt)
            if at < 0 or at > stop_at or context[:len(prompt)] != prompt:
                return Proposal()
            guesses = [free[j] if j != stop_at else wrong for j in range(at, min(at + k, stop_at + 3))]
            return Proposal(guesses, [1.0] * len(guesses))

        monkeypatch.setattr(SuffixDrafter, "propose", oracle)
        sp = SamplingParams(stop_token_ids=[stop], **greedy)
        got = {}
        for name, engine in (("plain", plain), ("spec", spec)):
            before = engine.get_stats().get("spec_accept_token_num", 0)
            sid = engine.open_session()
            turns = [engine.generate(input_ids=[p], sampling_params=sp, session_id=sid, return_logprob=True)[0]
                     for p in (prompt, follow)]
            engine.close_session(sid)
            history = prompt + turns[0].output_token_ids + follow
            assert turns[1].prompt_token_ids == history
            later = engine.generate(input_ids=[history], return_logprob=True, sampling_params=SamplingParams(
                speculative=False, **greedy))[0]
            accepted = engine.get_stats().get("spec_accept_token_num", 0) - before
            got[name] = [(o.output_token_ids, o.output_logprobs) for o in turns + [later]]
            # the later request reads the history's KV from the prefix cache, past the stop position
            assert later.num_cached_tokens > len(prompt) + stop_at
        assert got["spec"][0][0] == free[:stop_at + 1]  # the first turn ended on the stop token
        for (t1, lp1), (t2, lp2) in zip(got["plain"], got["spec"]):
            assert t1 == t2
            assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-4
        # every guess before the stop position was accepted and returned; none after it counts
        assert 0 < accepted <= stop_at - 1

        def right_past_the_stop(self, key, context, k):
            """Plain decoding's tokens through the stop position and past it: all accepted, none after the
            stop returned."""
            at = len(context) - len(prompt)
            if at < 0 or at >= len(free) or context[:len(prompt)] != prompt:
                return Proposal()
            guesses = free[at:at + k]
            return Proposal(guesses, [1.0] * len(guesses))

        monkeypatch.setattr(SuffixDrafter, "propose", right_past_the_stop)
        # chunks of four guesses from output 1 (all accepted: outputs 1-5), then from output 6: a stop drawn at
        # 6, 7 or 8 leaves accepted guesses after it in that chunk
        stop2 = next(k for k in (6, 7, 8) if free[k] not in free[:k])
        o = spec.generate(input_ids=[prompt], sampling_params=SamplingParams(stop_token_ids=[free[stop2]], **greedy))[0]
        assert o.output_token_ids == free[:stop2 + 1] and o.spec_verify_ct == 2
        assert 0 < o.spec_accept_token_num <= len(o.output_token_ids) - 1  # the first token is the prefill's
