"""A hand-computed GiGPO case with two near-identical observations, shared by the credit and bridge tests.

One task group, two rollouts of two steps: rollout 0 sees ``DRAWER2`` then ``"x"`` and gets reward 1 at t = 1;
rollout 1 sees ``DRAWER3`` then ``"y"`` and gets 0. The two first observations are 35 characters that differ in one,
so difflib's ratio is 2 * 34 / 70 = 68/70 ~ 0.971: merged at a threshold of 0.95, not at 0.98.
"""

import math

DRAWER2, DRAWER3 = "You see a cabinet 1 and a drawer 2.", "You see a cabinet 1 and a drawer 3."
#: the state of each row, rows in (traj, t) order (0, 0), (0, 1), (1, 0), (1, 1)
TEXTS = [DRAWER2, "x", DRAWER3, "y"]
REWARDS = [0.0, 1.0, 0.0, 0.0]


def expected_gigpo(merged: bool) -> list[float]:
    """GiGPO's defaults (gamma 0.95, w/ std, eps 1e-6, episode statistics over steps) on :data:`TEXTS`.

    A^E: the rows carry returns [1, 1, 0, 0], mean 0.5, unbiased std sqrt(1/3). A^S: every exact anchor is a
    singleton (0); merged, the two t = 0 rows form one anchor with R_0 = [0.95, 0], mean 0.475, std 0.475 sqrt(2).
    """
    a_e = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    a_s = 0.475 / (0.475 * math.sqrt(2) + 1e-6) if merged else 0.0
    return [a_e + a_s, a_e, -a_e - a_s, -a_e]
