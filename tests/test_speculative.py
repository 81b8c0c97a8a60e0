"""Speculative decoding's parts that need no engine: the suffix drafter (``rollout.speculative.drafter``)."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_the_acceptance_benchmark_writes_its_numbers_and_plot(tmp_path):
    from rollout.bench import acceptance

    res = acceptance.main(["--model", "tiny", "--num-prompts", "2", "--n", "2", "--max-new-tokens", "12",
                           "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path)])
    assert set(res["sources"]) == {"rollouts", "siblings", "own", "all", "all-tree"} and res["config"]["train"] == "on"
    for r in res["sources"].values():
        assert 0 < r["tokens"] <= 2 * 2 * 12 and r["tokens"] / 9 <= r["verify_steps"] <= r["tokens"]
    assert (tmp_path / "acceptance_tiny_bfloat16_k8_train-on.png").exists()


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
