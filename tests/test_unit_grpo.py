"""The GRPO loss, its mismatch record and the loop's config, without an engine or a trainer."""

import math

import pytest
import torch

from trainer_bridge.grpo import DistCheck, DistProbe, GRPOConfig, Mismatch, group_advantages, grpo_loss


def _lp(*rows):
    return [torch.tensor(r, dtype=torch.float32, requires_grad=True) for r in rows]


def test_on_policy_loss_is_minus_the_mean_advantage_and_its_gradient_follows_it():
    cfg = GRPOConfig(release_memory=False)
    new = _lp([-1.0, -2.0], [-0.5, -0.25, -3.0])
    engine = [t.detach().clone() for t in new]
    adv = torch.tensor([1.5, -0.5])
    loss, mm = grpo_loss(cfg, new, engine, adv)
    assert loss.item() == pytest.approx(-(1.5 - 0.5) / 2)
    loss.backward()
    # d/d lp of -ratio * a / len / N at ratio 1: -a / (len * N), per token
    assert torch.allclose(new[0].grad, torch.full((2,), -1.5 / (2 * 2)))
    assert torch.allclose(new[1].grad, torch.full((3,), 0.5 / (3 * 2)))
    assert mm.count == 5 and mm.abs_sum == 0 and mm.abs_max == 0 and mm.ratio_mean == pytest.approx(1.0)


def test_the_clip_stops_the_gradient_outside_the_band():
    cfg = GRPOConfig(release_memory=False, clip_eps=0.2)
    new = _lp([math.log(1.5)])  # ratio 1.5 > 1 + eps with a positive advantage: clipped, no gradient
    loss, _ = grpo_loss(cfg, new, [torch.tensor([0.0])], torch.tensor([2.0]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 * 2.0) and new[0].grad.abs().max() == 0
    new = _lp([math.log(1.1)])  # inside the band: the ratio's gradient
    loss, _ = grpo_loss(cfg, new, [torch.tensor([0.0])], torch.tensor([2.0]))
    loss.backward()
    assert new[0].grad.item() == pytest.approx(-2.0 * 1.1, rel=1e-5)


def test_stale_tokens_are_dropped_or_weighted_past_the_bound():
    new = _lp([-1.0, -1.0, -1.0])
    engine = [torch.tensor([-1.0, -1.0, -1.2])]
    ages = [[0, 1, 3]]  # the last token is 3 versions behind; the bound is 1
    keep, _ = grpo_loss(GRPOConfig(release_memory=False, max_staleness=1, stale_policy="keep"), new, engine,
                        torch.tensor([1.0]), ages)
    drop, _ = grpo_loss(GRPOConfig(release_memory=False, max_staleness=1, stale_policy="drop"), new, engine,
                        torch.tensor([1.0]), ages)
    tis, _ = grpo_loss(GRPOConfig(release_memory=False, max_staleness=1, stale_policy="tis", tis_cap=None), new,
                       engine, torch.tensor([1.0]), ages)
    r = math.exp(0.2)
    pg_last = -min(r, 1.2) * 1.0
    assert keep.item() == pytest.approx((-1 - 1 + pg_last) / 3, rel=1e-6)
    assert drop.item() == pytest.approx((-1 - 1 + 0) / 3, rel=1e-6)
    assert tis.item() == pytest.approx((-1 - 1 + pg_last * min(r, 2.0)) / 3, rel=1e-6)


def test_the_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    cfg = GRPOConfig(release_memory=False, kl_coef=0.5)
    new = _lp([-1.0, -2.0])
    engine = [t.detach().clone() for t in new]
    at_ref, _ = grpo_loss(cfg, new, engine, torch.tensor([1.0]), ref_lp=[t.detach().clone() for t in new])
    away, _ = grpo_loss(cfg, new, engine, torch.tensor([1.0]), ref_lp=[torch.tensor([-1.5, -2.5])])
    assert at_ref.item() == pytest.approx(-1.0) and away.item() > at_ref.item()


def test_mismatch_record_names_every_figure():
    new = _lp([-1.0, -2.0], [-3.0])
    engine = [torch.tensor([-1.0, -2.5]), torch.tensor([-2.8])]
    unmasked = [torch.tensor([-1.05, -2.0]), torch.tensor([-3.0])]
    _, mm = grpo_loss(GRPOConfig(release_memory=False), new, engine, torch.tensor([0.0, 0.0]), unmasked_lp=unmasked)
    assert mm.count == 3
    assert mm.mean == pytest.approx((0 + 0.5 + 0.2) / 3, rel=1e-5) and mm.abs_max == pytest.approx(0.5, rel=1e-5)
    assert mm.unmasked_mean == pytest.approx((0.05 + 0.5 + 0.2) / 3, rel=1e-5)
    assert mm.unmasked_abs_max == pytest.approx(0.5, rel=1e-5)
    assert mm.ratio_mean == pytest.approx((1 + math.exp(0.5) + math.exp(-0.2)) / 3, rel=1e-5)
    # unmasked ratios exp(-0.05), exp(0.5), exp(-0.2): two lie outside [0.9, 1.1]
    assert mm.unmasked_out_of_band == 2 and mm.unmasked_out_of_band_fraction == pytest.approx(2 / 3)
    assert mm.reduced() == mm and isinstance(mm, Mismatch)  # no process group: its own figures


def test_group_advantages_are_normalised_within_each_prompt():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 5.0, 5.0]), n=4)
    assert torch.allclose(adv[:4].sum(), torch.tensor(0.0), atol=1e-6) and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: no signal


@pytest.mark.parametrize("kw, says", [
    (dict(release_memory=True, push_weights=False), "without push_weights"),
    (dict(stale_policy="later"), "stale_policy"),
    (dict(temperature=0.0), "temperature"),
    (dict(n=0), "GRPOConfig.n"),
    (dict(max_staleness=1, release_memory=True), "own devices"),
    (dict(clip_eps=1.5), "clip_eps"),
    (dict(tis_cap=0.0), "tis_cap"),
    (dict(dist_check_samples=-1), "dist_check_samples"),
    (dict(true_on_policy=True, top_k=20), "temperature sampling only"),
    (dict(delta_anchor_every=2), "needs delta_sync"),
])
def test_the_config_is_checked_when_it_is_built(kw, says):
    with pytest.raises(ValueError, match=says):
        GRPOConfig(**kw)


def test_the_full_distribution_check_is_zero_only_for_the_same_distribution():
    """``DistCheck``: the largest |engine - trainer| over the vocabulary and KL(engine || trainer) at logits / T,
    ids the engine did not report left out; exactly 0 for the same logits, positive otherwise."""
    logits = torch.randn(3, 11)
    T = 0.7
    engine = torch.log_softmax(logits / torch.full((3, 1), T), dim=-1)
    probe = DistProbe([1, 2, 3, 4, 5], 2, engine.clone())
    same = DistCheck.of([probe], [logits], T)
    assert (same.max_abs, same.kl_sum, same.positions) == (0.0, 0.0, 3)
    moved = logits.clone()
    moved[1, 4] += 0.5
    other = DistCheck.of([probe], [moved], T)
    assert other.max_abs > 0.5 and other.kl_mean > 0
    expected_kl = float((engine.exp() * (engine - torch.log_softmax(moved / T, dim=-1))).sum()) / 3
    assert math.isclose(other.kl_mean, expected_kl, rel_tol=1e-5)
    probe.engine_lp[0, 5] = float("-inf")  # an id the engine did not report: left out, not a nan
    assert math.isfinite(DistCheck.of([probe], [moved], T).kl_sum)

