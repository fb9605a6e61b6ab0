from __future__ import annotations

import numpy as np

from actors.environment.workloads import PROFILES, choose_family, cumulative, pick, plan_trajectory


def test_same_seeds_give_the_same_trajectory():
    a = plan_trajectory(PROFILES["swe"], 1, 42)
    b = plan_trajectory(PROFILES["swe"], 1, 42)
    assert (a.turns, a.prompt_tokens) == (b.turns, b.prompt_tokens)
    assert [a.gen_tokens() for _ in range(5)] == [b.gen_tokens() for _ in range(5)]
    c = plan_trajectory(PROFILES["swe"], 2, 42)
    assert [a.tool_latency_s() for _ in range(5)] != [c.tool_latency_s() for _ in range(5)]


def test_profiles_respect_their_published_bounds():
    for name, profile in PROFILES.items():
        for seed in range(200):
            plan = plan_trajectory(profile, 0, seed)
            assert 1 <= plan.turns <= 50, name
            assert plan.gen_tokens() <= profile.gen_tokens.hi
            assert plan.tool_latency_s() >= 0


def test_swe_turns_centre_near_the_published_median():
    turns = sorted(plan_trajectory(PROFILES["swe"], 0, s).turns for s in range(2001))
    assert 17 <= turns[1000] <= 23  # LN(20, 0.6) clipped to [3, 50]


def test_overrides_clip_and_scale():
    plan = plan_trajectory(PROFILES["swe"], 0, 5, turns_max=4, gen_scale=0.0)
    assert plan.turns <= 4 and plan.gen_tokens() == 1


def test_family_mix_is_followed():
    picks = [choose_family({"swe": 0.25, "math": 0.75}, 0, 0, k) for k in range(2000)]
    assert 0.2 < picks.count("swe") / len(picks) < 0.3


def test_pick_draws_what_rng_choice_draws_from_the_same_stream():
    probs = (0.35, 0.35, 0.2, 0.1)
    ours, numpys = np.random.default_rng(3), np.random.default_rng(3)
    cdf = cumulative(probs)
    assert [pick(ours, cdf) for _ in range(5000)] == [int(numpys.choice(4, p=probs)) for _ in range(5000)]
    assert ours.random() == numpys.random()  # one uniform per draw, as numpy's choice
