"""The adaptive-k policy: it speculates where verification is cheap and stops where it is not."""

from __future__ import annotations

import numpy as np
import pytest

from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.stats import NGRAM
from tests.policy_timing import modelled_step_times


def _drive(policy: SpeculationPolicy, rows: int, t_draft: float, t_target, acceptance: float, steps: int = 200):
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(steps):
        k = policy.choose(rows, limit=8)
        chosen.append(k)
        policy.observe_step(rows, k, k * t_draft, t_target(k + 1), k * t_draft + t_target(k + 1))
        if k:
            accepted = np.minimum(rng.geometric(1 - acceptance, size=rows) - 1, k)
            policy.observe_acceptance(accepted, np.full(rows, k))
    return chosen


def test_speculates_fully_when_verification_is_flat_and_acceptance_high():
    policy = SpeculationPolicy(4, fixed=False)
    chosen = _drive(policy, rows=1, t_draft=0.001, t_target=lambda n: 0.010, acceptance=0.8)
    assert np.mean(chosen[-50:]) > 3.5


def test_stops_speculating_when_verification_costs_per_token():
    # compute-bound target: verifying n tokens costs n single-token steps; no k can pay
    policy = SpeculationPolicy(4, fixed=False)
    chosen = _drive(policy, rows=16, t_draft=0.002, t_target=lambda n: 0.010 * n, acceptance=0.6)
    assert np.mean(np.array(chosen[-50:]) == 0) > 0.85


def test_a_cold_start_measures_the_draft_before_it_rests():
    """A short job's first draft step keeps none of its tokens, and the first forward of each width and
    of each number of draft forwards costs three times its later ones (kernels built, memory touched
    first). Steady costs are the real pair's at batch 1 on the 2-core CPU: a target forward about flat
    in width, a draft forward 0.4 of it, acceptance 0.85, where k = 3-4 pay about 1.5x. Priced by the
    prior and that first step, the policy rested through most of the job (mean k 0.30 where k = 3 fixed
    paid 1.61x); it must measure the draft model on a few steps of K first, and then speculate."""
    policy = SpeculationPolicy(4, fixed=False)
    rng = np.random.default_rng(0)
    seen: set[tuple[str, int]] = set()

    def first_slow(kind: str, n: int, seconds: float) -> float:
        slow = (kind, n) not in seen
        seen.add((kind, n))
        return 3 * seconds if slow else seconds

    chosen = []
    for step in range(40):  # a 48-token request's steps
        k = policy.choose(1, limit=8)
        chosen.append(k)
        t_draft = first_slow("draft", k, 0.14 * k) if k else 0.0
        t_target = first_slow("target", k + 1, 0.37 if k == 0 else 0.35)
        policy.observe_step(1, k, t_draft, t_target, t_draft + t_target)
        if k:
            accepted = np.minimum(rng.geometric(0.15, size=1) - 1, k) if step else np.zeros(1, np.int64)
            policy.observe_acceptance(accepted, np.full(1, k))
    assert np.mean(chosen) >= 3.0, chosen


def test_fixed_k_is_fixed_but_respects_the_limit():
    policy = SpeculationPolicy(4, fixed=True)
    assert policy.choose(8, limit=8) == 4
    assert policy.choose(8, limit=2) == 2
    assert policy.choose(8, limit=0) == 0


def test_expected_tokens_uses_per_position_acceptance():
    policy = SpeculationPolicy(3, fixed=False)
    for _ in range(2000):
        policy.observe_acceptance(np.array([3, 1, 0, 2]), np.array([3, 3, 3, 3]))
    alpha = policy.acceptance()
    assert np.allclose(alpha, [3 / 4, 2 / 3, 1 / 2], atol=0.02)
    assert np.isclose(policy.expected_tokens_by_length()[3], 1 + 0.75 + 0.5 + 0.25, atol=0.03)


def test_deep_positions_it_rarely_reached_are_estimated_from_the_others():
    # the policy only ever offered one draft token: positions 2..4 borrow position 1's acceptance
    policy = SpeculationPolicy(4, fixed=False)
    for _ in range(200):
        policy.observe_acceptance(np.array([1, 1, 1, 0]), np.array([1, 1, 1, 1]))
    assert np.allclose(policy.acceptance(), 0.75, atol=0.02)


def test_recovers_full_k_after_a_bad_start():
    # the first prompts are hard for the draft, then it agrees with the target 90% of the time: the
    # policy must climb back to K instead of staying where the bad start left it
    policy = SpeculationPolicy(4, fixed=False)
    _drive(policy, rows=1, t_draft=0.001, t_target=lambda n: 0.010 + 0.001 * n, acceptance=0.05, steps=60)
    chosen = _drive(policy, rows=1, t_draft=0.001, t_target=lambda n: 0.010 + 0.001 * n, acceptance=0.9, steps=300)
    assert np.mean(chosen[-60:]) > 3.5


def test_one_slow_step_does_not_move_the_choice():
    policy = SpeculationPolicy(4, fixed=False)
    _drive(policy, rows=1, t_draft=0.001, t_target=lambda n: 0.010, acceptance=0.8, steps=100)
    policy.observe_step(1, 4, 0.004, 5.0, 5.004)  # a garbage collection, a neighbour's burst
    chosen = _drive(policy, rows=1, t_draft=0.001, t_target=lambda n: 0.010, acceptance=0.8, steps=5)
    assert chosen[:4] == [4, 4, 4, 4]


def _measured(policy: SpeculationPolicy, rows: int, t_target) -> None:
    for width in range(1, policy.max_k + 2):
        for _ in range(3):
            policy.observe_step(rows, width - 1, 0.0, t_target(width), t_target(width))


def test_a_few_matching_rows_do_not_widen_a_compute_bound_batch():
    # verification costs its width (a CPU at 16 rows); model-free proposals accepted at 90%
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    _measured(policy, 16, lambda width: 0.010 * width)
    for _ in range(50):
        policy.observe_acceptance(np.array([4, 3, 4]), np.array([4, 4, 4]), np.array([1, 1, 1]))
    sources = np.ones(16, np.int64)
    one_match = np.array([4] + [0] * 15)
    assert policy.choose(16, 4, one_match, sources) == 0
    # where verification is flat (a GPU at small batch) the same single match is worth its width
    flat = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    _measured(flat, 16, lambda width: 0.010)
    for _ in range(50):
        flat.observe_acceptance(np.array([4, 3, 4]), np.array([4, 4, 4]), np.array([1, 1, 1]))
    assert flat.choose(16, 4, one_match, sources) == 4


def test_acceptance_is_measured_per_proposer():
    policy = SpeculationPolicy(4, fixed=False)
    for _ in range(50):
        policy.observe_acceptance(np.array([4, 0]), np.array([4, 4]), np.array([1, 0]))
    assert policy.acceptance(1).min() > 0.9 and policy.acceptance(0).max() < 0.1


def test_a_shrinking_batch_borrows_its_neighbours_curve_instead_of_warming_up_again():
    # measured at 16 rows, compute-bound: speculation does not pay; at 15, 14, ... rows (a job's tail,
    # compacted row by row) the policy must not spend a full-width warm-up step on every new row count
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    _measured(policy, 16, lambda width: 0.010 * width)
    for _ in range(50):
        policy.observe_acceptance(np.full(16, 1), np.full(16, 4))
    assert [policy.choose(rows, 4) for rows in range(15, 0, -1)] == [0] * 15


def test_probes_back_off_while_they_change_nothing():
    policy = SpeculationPolicy(4, fixed=False, probe_interval=16)
    chosen = _drive(policy, rows=16, t_draft=0.002, t_target=lambda n: 0.010 * n, acceptance=0.6, steps=1000)
    # without the back-off: a probe every 16 steps, ~56 of them after the first 100
    assert np.count_nonzero(chosen[100:]) <= 12


def test_the_full_k_is_probed_only_where_its_estimate_is_near_the_best():
    # compute-bound: the full K, about 5 plain steps' time for at most 2.3 tokens a row, is never probed again
    resting = SpeculationPolicy(4, fixed=False, probe_interval=16)
    chosen = _drive(resting, rows=16, t_draft=0.002, t_target=lambda n: 0.010 * n, acceptance=0.6, steps=1000)
    assert 4 not in chosen[100:] and 1 in chosen[100:]
    # verifying more tokens costs little more: k = 2 is best and the full K is close, so it is still probed
    cheap = SpeculationPolicy(4, fixed=False, probe_interval=16)
    chosen = _drive(cheap, rows=1, t_draft=0.002, t_target=lambda n: 0.010 + 0.001 * n, acceptance=0.6, steps=1000)
    assert np.median(chosen[100:]) == 2 and 4 in chosen[100:]


def test_a_looked_up_proposal_is_not_charged_for_draft_forwards():
    # the draft model's forwards cost as much as the verify: a draft proposal does not pay, a looked-up
    # one, with the same acceptance and free to make, does
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    for width in range(1, 6):
        for _ in range(3):
            policy.observe_step(1, width - 1, 0.010 * (width - 1), 0.010 + 0.001 * width, 0.011 * width)
    for source in (0, 1):
        for _ in range(50):
            policy.observe_acceptance(np.array([2]), np.array([4]), np.array([source]))
    offers = np.array([4])
    assert policy.best(1, 4, offers, np.array([0]))[0] == 0
    assert policy.best(1, 4, offers, np.array([1]))[0] > 0


def test_a_proposer_locked_out_by_bad_luck_is_tried_again():
    # the suffix index's first proposals were rejected, so the hybrid stopped choosing it: its estimate
    # must drift back towards its prior as the steps go by, or it would never be measured again
    policy = SpeculationPolicy(4, fixed=False)
    for _ in range(5):
        policy.observe_acceptance(np.array([0]), np.array([4]), np.array([2]))
    assert policy.acceptance(2).mean() < 0.3
    for _ in range(400):
        policy.observe_acceptance(np.array([2]), np.array([4]), np.array([0]))
    assert policy.acceptance(2).mean() > 0.6


def test_k_defaults_to_more_for_a_model_free_proposer_and_an_explicit_k_wins():
    from specq.decoding.config import DecodingConfig

    assert DecodingConfig().num_speculative_tokens == 4
    assert DecodingConfig(model_free="ngram").num_speculative_tokens == 8
    # a wide verify costs a few rows little more than a plain step: there a long match pays up to 16
    assert DecodingConfig(model_free="ngram", batch_size=4).num_speculative_tokens == 16
    assert DecodingConfig(model_free="ngram", batch_size=5).num_speculative_tokens == 8
    assert DecodingConfig(model_free="suffix", num_speculative_tokens=3).num_speculative_tokens == 3


def test_a_hybrids_draft_model_goes_as_deep_as_alone_unless_k_is_given():
    from specq.decoding.config import DecodingConfig

    depths = [
        (c.num_speculative_tokens, c.draft_model_depth)
        for c in (
            DecodingConfig(),
            DecodingConfig(model_free="suffix"),
            DecodingConfig(model_free="suffix", num_speculative_tokens=6),
            DecodingConfig(model_free="suffix", num_speculative_tokens=2),
            DecodingConfig(num_speculative_tokens=6),
        )
    ]
    assert depths == [(4, 4), (8, 4), (6, 6), (2, 2), (6, 6)]
    stored = DecodingConfig(model_free="suffix").to_dict()
    assert DecodingConfig(**stored) == DecodingConfig(model_free="suffix")  # a job's stored config round-trips
    with pytest.raises(ValueError, match="draft_model_depth"):
        DecodingConfig(num_speculative_tokens=4, draft_model_depth=5)


def test_engines_share_a_policy_only_on_the_same_models_and_speculation_settings():
    from specq.decoding.config import DecodingConfig

    def key(config: DecodingConfig, dtype: str | None = None) -> tuple:
        return config.policy_key("target", "draft", dtype)

    base = DecodingConfig(num_speculative_tokens=4)
    assert key(base) == ("target", "draft", None, 4, False, None)
    assert key(DecodingConfig(num_speculative_tokens=4, batch_size=32)) == key(base)  # it times each row count apart
    others = [
        key(base, "float16"),
        key(DecodingConfig(num_speculative_tokens=6)),
        key(DecodingConfig(num_speculative_tokens=4, fixed_k=True)),
        key(DecodingConfig(num_speculative_tokens=4, model_free="ngram")),
        DecodingConfig(num_speculative_tokens=4).policy_key("target", None, None),
    ]
    assert key(base) not in others and len(set(others)) == len(others)


def test_after_choosing_no_speculation_it_rests_without_offers_until_the_next_probe():
    # compute-bound: k = 0 wins, and until a probe is due the engine is told to make no offers
    policy = SpeculationPolicy(4, fixed=False, probe_interval=16)
    _measured(policy, 16, lambda width: 0.010 * width)
    for _ in range(50):
        policy.observe_acceptance(np.full(16, 1), np.full(16, 4))
    assert policy.wants_offers(16)
    assert policy.choose(16, 4) == 0
    resting = 0
    while not policy.wants_offers(16):
        policy.rest()
        resting += 1
    assert 0 < resting < 16
    assert policy.choose(16, 4) > 0  # the probe
    assert not policy.wants_offers(16)  # the probe changed nothing: back to resting
    assert policy.wants_offers(8)  # another row count has its own choice to make
    assert SpeculationPolicy(4, fixed=True).wants_offers(16)


def _policy_where_plain_wins(offers_s: float) -> SpeculationPolicy:
    """A batch-1 policy whose plain step takes 10 ms (a width w verify w times that), whose offers take
    `offers_s`, and whose one row's lookups are rarely accepted: k = 0 is its choice."""
    policy = SpeculationPolicy(4, fixed=False, probe_interval=16)
    for width in range(1, 6):
        for _ in range(3):
            policy.observe_step(1, width - 1, 0.0, 0.010 * width, 0.010 * width + offers_s, t_offer=offers_s)
    for _ in range(50):
        policy.observe_acceptance(np.array([0]), np.array([4]), np.array([1]))  # rarely accepted
    return policy


def test_it_does_not_rest_where_the_offers_cost_next_to_nothing():
    # k = 0 wins, but a lookup costs 0.05 ms against a 10 ms plain step: resting would save nothing and
    # miss the matches that come up before the next probe
    policy = _policy_where_plain_wins(0.00005)
    assert policy.choose(1, 4, np.array([4]), np.array([1])) == 0
    assert all(policy.wants_offers(1) for _ in range(3))
    for _ in range(15):  # the offers now cost a tenth of a plain step: it rests
        policy.observe_step(1, 0, 0.0, 0.010, 0.011, t_offer=0.001)
    assert not policy.wants_offers(1)


def test_a_hybrid_rests_by_its_lookups_time_not_its_plans():
    # the hybrid's offers (lookups and plan) cost 2% of a plain step, its lookups alone 0.5%: resting
    # would save the plan's time and lose the lookups' matches, so it keeps asking; a plain proposer
    # whose offers cost the same 2% rests
    def resting_policy(lookup_s: float | None) -> SpeculationPolicy:
        policy = _policy_where_plain_wins(0.0002)
        if lookup_s is not None:
            mix = policy.best_mix(1, np.array([4]), np.array([0]), np.array([1]))
            for _ in range(3):
                policy.observe_lookups(1, lookup_s, mix)
        assert policy.choose(1, 4, np.array([4]), np.array([1])) == 0
        return policy

    assert not resting_policy(None).wants_offers(1)
    assert resting_policy(0.00005).wants_offers(1)
    assert not resting_policy(0.00015).wants_offers(1)  # lookups over the line: it rests, as before


def test_the_offers_time_is_charged_to_speculating_only():
    # verification is flat and cheap; the offers (a suffix-index walk) cost as much as a verify: a plain
    # step does not make them, so speculation must earn them back
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    for width in range(1, 6):
        for _ in range(3):
            policy.observe_step(1, width - 1, 0.0, 0.010, 0.021, t_offer=0.010)
    times = policy.step_times(1, 4, draft_depth=0)
    assert times[0] == pytest.approx(0.011)
    assert times[1:] == pytest.approx([0.021] * 4)
    for _ in range(50):
        policy.observe_acceptance(np.array([0]), np.array([4]), np.array([1]))  # rarely accepted
    assert policy.best(1, 4, np.array([4]), np.array([1]))[0] == 0


def test_a_step_pays_for_as_many_draft_forwards_as_its_deepest_draft_model_row():
    # 2 ms a draft forward, 10 ms a verify at any width: a step whose draft-model rows take at most 2
    # tokens runs 2 draft forwards, however wide looked-up rows make the verify
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    for width in range(1, 6):
        for _ in range(3):
            policy.observe_step(1, width - 1, 0.002 * min(width - 1, 2), 0.010, 0.010, draft_forwards=2)
    # a forward is 2 ms (not 4 ms over k = 4 forwards)
    assert policy.step_times(1, 4) == pytest.approx([0.010, 0.012, 0.014, 0.016, 0.018])
    assert policy.step_times(1, 4, draft_depth=2) == pytest.approx([0.010, 0.012, 0.014, 0.014, 0.014])
    assert policy.step_times(1, 4, draft_depth=0) == pytest.approx([0.010] * 5)


def test_the_kept_estimates_follow_every_observation():
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    prior = policy.expected_tokens_by_length(0).copy()
    policy.observe_acceptance(np.array([0]), np.array([4]))  # the draft model's first token rejected
    assert policy.expected_tokens_by_length(0)[4] < prior[4]
    for width in range(1, 6):
        for _ in range(3):
            policy.observe_step(1, width - 1, 0.001 * (width - 1), 0.010, 0.010 + 0.001 * (width - 1))
    widest = policy.step_times(1, 4)[4]
    for _ in range(15):
        policy.observe_step(1, 4, 0.004, 0.050, 0.054)  # the widest verify turned slow
    assert policy.step_times(1, 4)[4] > widest


def test_a_steps_drafting_is_priced_by_its_forwards_not_as_that_many_times_one():
    # a step's first draft forward costs 1.2 ms (it catches up after the target's forward), each further
    # one 0.5 ms; a resting policy's probes ran one forward, one step ran four. Priced per forward (1.2
    # ms each), k = 4 would seem not to pay; it does: 3.36 tokens in 7.2 ms against one in 2.6 ms
    def target(width):
        return 0.0024 + 0.0004 * (width - 1)

    def drafting(forwards):
        return 0.0012 + 0.0005 * (forwards - 1)

    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    for _ in range(15):
        policy.observe_step(1, 0, 0.0, target(1), target(1) + 0.0002)
    policy.observe_step(1, 4, drafting(4), target(5), drafting(4) + target(5) + 0.0005)
    for _ in range(14):
        policy.observe_step(1, 1, drafting(1), target(2), drafting(1) + target(2) + 0.0005)
    rng = np.random.default_rng(0)
    for _ in range(300):
        policy.observe_acceptance(np.minimum(rng.geometric(0.2, size=1) - 1, 4), np.array([4]))
    assert policy.step_times(1, 4)[4] == pytest.approx(drafting(4) + target(5) + 0.0005)
    assert policy.step_times(1, 4)[2] == pytest.approx(drafting(2) + target(3) + 0.0005)
    assert policy.choose(1, limit=4) == 4


def test_an_early_rejection_does_not_keep_the_draft_model_out():
    # k = 4 pays (3.7 tokens in 7.2 ms against one in 2.6 ms at acceptance 0.85), but the draft model's
    # first token is rejected: from its neutral prior that makes speculation look as if it cannot pay.
    # Its probes go to the full K, without backing off, until its acceptance is measured on a few tokens
    def target(width):
        return 0.0024 + 0.0004 * (width - 1)

    def drafting(forwards):
        return 0.0012 + 0.0005 * (forwards - 1) if forwards else 0.0

    policy = SpeculationPolicy(4, fixed=False, probe_interval=16)
    rng = np.random.default_rng(0)
    chosen = []
    for step in range(200):
        if policy.wants_offers(1):
            k = policy.choose(1, limit=4)
        else:  # resting, as the engine does
            policy.rest()
            k = 0
        chosen.append(k)
        overhead = 0.0005 if k else 0.0002
        policy.observe_step(1, k, drafting(k), target(k + 1), drafting(k) + target(k + 1) + overhead)
        if k:
            accepted = 0 if step == 0 else min(rng.geometric(0.15) - 1, k)
            policy.observe_acceptance(np.array([accepted]), np.array([k]))
    assert np.mean(np.array(chosen[-100:]) == 4) > 0.8


def _drive_lookups(policy, rows, acceptance, steps, tokens_left=None):
    """Steps of a model-free proposer offering 8 tokens on every row, each position accepted with
    probability `acceptance`; the times are whatever the test modelled."""
    rng = np.random.default_rng(0)
    offers, sources = np.full(rows, 8), np.full(rows, NGRAM)
    chosen = []
    for _ in range(steps):
        k = policy.choose(rows, 8, offers, sources, tokens_left)
        chosen.append(k)
        policy.observe_step(rows, k, 0.0, 0.0, 0.0, t_offer=0.0, draft_forwards=0)
        if k:
            accepted = np.minimum(rng.geometric(1 - acceptance, size=rows) - 1, k)
            policy.observe_acceptance(accepted, np.full(rows, k), sources)
    return chosen


def test_a_batch_whose_verify_costs_its_width_converges_to_not_speculating(monkeypatch):
    # a CPU at 16 rows: verifying w tokens a row costs about w plain steps (plus a little), and half of
    # the looked-up tokens are accepted: no width returns what it costs, and the policy, starting from
    # its optimistic prior for lookups, must learn that from its own timings and stop
    policy = SpeculationPolicy(8, fixed=False)
    modelled_step_times(monkeypatch, policy, lambda rows, width: 0.160 * width + 0.004, t_offer=0.001)
    chosen = _drive_lookups(policy, 16, acceptance=0.5, steps=300)
    assert np.mean(np.array(chosen[-100:]) == 0) > 0.9
    assert policy.best(16, 8, np.full(16, 8), np.full(16, NGRAM))[0] == 0


def test_a_draining_batch_does_not_widen_for_rows_ahead_of_its_slowest(monkeypatch):
    # verifying 6 tokens costs 3.6 plain steps (SmolLM2 at 16 rows on one thread); lookups accepted at
    # 95%. Where every row offers, speculating pays with or without a queue; where the rows furthest
    # from their end have nothing to offer, it pays for a queue's batch (the early rows are refilled)
    # but not for a draining one, which ends with those rows
    steps = {1: 0.165, 3: 0.56, 6: 0.59, 9: 1.13}
    policy = SpeculationPolicy(5, fixed=False, probe_interval=10**9)
    widths, seconds = list(steps), list(steps.values())
    modelled_step_times(monkeypatch, policy, lambda rows, width: float(np.interp(width, widths, seconds)))
    for width in (1, 3, 6):
        for _ in range(3):
            policy.observe_step(16, width - 1, 0.0, 0.0, 0.0, t_offer=0.0, draft_forwards=0)
    sources = np.full(16, NGRAM)
    for _ in range(50):
        policy.observe_acceptance(np.full(16, 5), np.full(16, 5), sources)
    left = np.array([10] * 12 + [20] * 4)  # four rows behind the others
    every_row = np.full(16, 5)
    assert policy.best(16, 5, every_row, sources)[0] == 5
    assert policy.choose(16, 5, every_row, sources, left) == 5
    behind_without = np.array([5] * 12 + [0] * 4)
    assert policy.choose(16, 5, behind_without, sources) == 5
    assert policy.choose(16, 5, behind_without, sources, left) == 0
    # the same offers where the rows without a match are the ones ahead: the slowest rows' progress pays
    ahead_without = np.array([0] * 4 + [5] * 12)
    assert policy.choose(16, 5, ahead_without, sources, np.array([10] * 4 + [20] * 12)) == 5


def test_a_cold_hybrid_tries_the_draft_models_depth_not_a_lookups():
    """The first full steps measure the draft model: a row whose looked-up match runs 8 tokens does not
    widen them to 9 (at 16 rows on the 2-core CPU such steps cost several plain ones, a third of a short
    job's steps)."""
    policy = SpeculationPolicy(8, fixed=False)
    _measured(policy, 2, lambda width: 0.010)
    assert policy.choose(2, limit=8, offers=np.array([8, 4]), sources=np.array([NGRAM, 0])) == 4


def test_a_cold_policy_does_not_force_drafts_where_even_a_perfect_draft_could_not_pay():
    policy = SpeculationPolicy(4, fixed=False, probe_interval=10**9)
    _measured(policy, 16, lambda width: 0.010 * width)  # verification costs its width: a compute-bound batch
    assert policy.choose(16, limit=8) == 0
