"""UniOPSD (spec distill §7) and the successful-peer hindsight helpers (spec distill §3.4, §7.2 step 1)."""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_plugins as cp
from distill_plugins import hindsight
from credit_plugins.estimators import gigpo as gigpo_mod
from credit_plugins.estimators import uniopsd as mod
from distill_plugins.hindsight import choose_peers, last_action, peer_prefix

from tests.helpers.strategies import columns, step_batches

SETTINGS = settings(max_examples=40, deadline=None)
HEADER = "[Privileged Hindsight Information]\nAnother attempt at this exact task succeeded. Its action sequence was:\n"


# ---- building batches --------------------------------------------------------------------------------------------
def table(rows, logp_old, logp_teacher, mask):
    ex = {"logp_old": torch.as_tensor(logp_old), "logp_teacher": torch.as_tensor(logp_teacher),
          "response_mask": torch.as_tensor(mask)}
    return cp.StepTable(**columns(rows), extras=ex)


def rows_of(spec, group="g"):
    """rows from {traj: (success, [state, ...])}; a success is paid 10 at its last step, a failure 0"""
    rows = []
    for traj, (win, states) in spec.items():
        for t, s in enumerate(states):
            paid = 10.0 if win and t == len(states) - 1 else 0.0
            rows.append(dict(group=group, traj=traj, t=t, state=s, action="a", reward=paid, success=win,
                             truncated=False))
    return rows


@st.composite
def token_batches(draw, max_groups=3, max_rollouts=5, max_len=5):
    """step_batches rows plus logp_old / logp_teacher / response_mask [S, L]: the failed trajectories of groups with a
    success are taught (choose_peers' rule, or every row with `anywhere`), some rows have no mask token, and the
    padding sometimes holds NaN."""
    rows = draw(step_batches(max_groups=max_groups, max_rollouts=max_rollouts, max_len=max_len))
    n, length = len(rows), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logp_old = -rng.exponential(1.0, (n, length))
    mask = rng.random((n, length)) < 0.8
    mask[rng.random(n) < 0.1] = False
    ret = defaultdict(float)
    for r in rows:
        ret[r["traj"]] += r["reward"]
    group_wins = {r["group"] for r in rows if ret[r["traj"]] >= 1.0}
    if draw(st.booleans()):
        taught = np.array([r["group"] in group_wins and ret[r["traj"]] < 1.0 for r in rows])
    else:
        taught = rng.random(n) < 0.5
    noise = rng.normal(0.0, draw(st.sampled_from([0.05, 0.3, 1.0])), (n, length))
    logp_teacher = np.where(taught[:, None], logp_old + noise, logp_old)
    if draw(st.booleans()):
        logp_old[~mask], logp_teacher[~mask] = np.nan, -np.inf
    return rows, logp_old, logp_teacher, mask.astype(np.float32)


states = st.fixed_dictionaries({
    "step": st.integers(0, 120),
    "rho_ema": st.one_of(st.none(), st.floats(-1.0, 1.0), st.floats(0.2, 1.0)),
    "n_prev": st.integers(0, 60),
})
params = st.fixed_dictionaries({
    "lam0": st.sampled_from([0.0, 0.5, 1.0]),
    "clip_eps": st.sampled_from([0.0, 0.2, 0.5]),
    "rho_shrink_z": st.sampled_from([0.0, 0.0, 2.33]),
    "frozen_rho": st.sampled_from([None, None, None, 0.25, 0.6]),
    "a_reliability": st.sampled_from([0.2, 0.5, 1.0]),
    "step_weight": st.sampled_from([0.5, 1.0]),
    "gamma": st.sampled_from([0.95, 1.0]),
})


def run(steps, state=None, **p):
    est = mod.ESTIMATOR.create(**p)
    if state is not None:
        est.load_state_dict(state)
    out = est(steps)
    return est, out


def gigpo_tokens(steps, mask, **p):
    """GiGPO mean_norm broadcast on mask tokens (input order)"""
    adv = gigpo_mod.ESTIMATOR(steps, norm_std=False, **p)
    return adv[:, None] * torch.as_tensor(mask).bool()


# ---- naive reference: spec distill §7.2 row by row, in input order ---------------------------------------------------
def lower_median(x):
    return float(np.sort(np.asarray(x))[(len(x) - 1) // 2])


def naive_uniopsd(rows, logp_old, logp_teacher, mask, state, gamma=0.95, step_weight=1.0, a_reliability=0.5,
                  rho_decay=0.9, rho_shrink_z=2.33, lam0=0.5, warmdown_steps=100, clip_eps=0.2, eps=1e-6,
                  frozen_rho=None):
    n, length = mask.shape
    mask = mask.astype(bool)
    reward = [float(np.float32(r["reward"])) for r in rows]
    by_traj, by_group, by_anchor = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, r in enumerate(rows):
        by_traj[r["traj"]].append(i)
        by_group[r["group"]].append(i)
        by_anchor[(r["group"], r["state"])].append(i)
    ret = {k: sum(reward[i] for i in idx) for k, idx in by_traj.items()}
    rtg = [0.0] * n
    for idx in by_traj.values():
        acc = 0.0
        for i in sorted(idx, key=lambda i: -rows[i]["t"]):
            acc = reward[i] + gamma * acc
            rtg[i] = acc
    a_e = [0.0] * n
    for idx in by_group.values():
        mean = 0.0 if len(idx) == 1 else sum(ret[rows[i]["traj"]] for i in idx) / len(idx)
        for i in idx:
            a_e[i] = ret[rows[i]["traj"]] - mean
    delta = np.where(mask, logp_teacher - logp_old, 0.0)
    n_tok = np.maximum(mask.sum(1), 1)
    dbar = delta.sum(1) / n_tok
    var_t = (np.where(mask, delta - dbar[:, None], 0.0) ** 2).sum(1) / n_tok
    taught = np.abs(delta).sum(1) > 0
    a_s, d, n_k, var_r, has_step = [0.0] * n, [0.0] * n, [0] * n, [0.0] * n, [False] * n
    for idx in by_anchor.values():
        vals = [rtg[i] for i in idx]
        const = max(vals) - min(vals) <= 1e-9 * (1 + max(abs(v) for v in vals))
        mean, dmean = sum(vals) / len(idx), sum(dbar[i] for i in idx) / len(idx)
        var = 0.0 if len(idx) == 1 else sum((v - mean) ** 2 for v in vals) / (len(idx) - 1)
        for i in idx:
            a_s[i] = 0.0 if const else step_weight * (rtg[i] - mean)
            d[i], n_k[i], var_r[i] = dbar[i] - dmean, len(idx), var
            has_step[i] = len(idx) >= 2 and not const
    tt = [i for i in range(n) if taught[i]]
    s = 0.0
    if len(tt) > 1:
        sd = float(np.std([d[i] for i in tt], ddof=1))
        if sd > eps:
            s = float(np.std([a_s[i] for i in tt], ddof=1)) / (sd + eps)
    a_o = [s * x for x in d]
    both = [has_step[i] and taught[i] for i in range(n)]
    prec_s = [n_k[i] / max(var_r[i], eps) if has_step[i] else 0.0 for i in range(n)]
    prec_o = [1 / max(var_t[i] / n_tok[i] * s * s, eps) if taught[i] else 0.0 for i in range(n)]

    def z(prec, own):
        pool = [i for i in range(n) if both[i]] or [i for i in range(n) if own[i]]
        med = lower_median([prec[i] for i in pool]) if pool else 1.0
        return [prec[i] / max(med, eps) if own[i] else 0.0 for i in range(n)]

    z_s, z_o = z(prec_s, has_step), z(prec_o, taught)
    if frozen_rho is not None:
        rho_hat = frozen_rho
    elif state["rho_ema"] is None:
        rho_hat = 0.0
    else:
        rho_hat = max(0.0, state["rho_ema"] - rho_shrink_z / math.sqrt(max(state["n_prev"], 1) / (1 - rho_decay)))
    u = min(max(a_reliability, 1e-3), 1.0)
    q = min(min(rho_hat, 1.0) ** 2, u * (1 - 1e-6))
    cs = u * (u - q) / (u * u - 2 * u * q + q)
    c = [1.0] * n
    if cs < 1 - 1e-6:
        a = cs / (1 - cs)
        for i in range(n):
            if both[i]:  # the denominator floored at eps (the authors' code; tiny c* and z^O hit the floor)
                total = a * z_s[i] + z_o[i]
                c[i] = min(a * z_s[i] / max(total, eps), 1.0) if total > 0 else 1.0
            elif taught[i]:
                c[i] = cs
    f = [c[i] * a_s[i] + (1 - c[i]) * a_o[i] for i in range(n)]
    m = state["step"] + 1
    lam = lam0 * max(1 - m / warmdown_steps, 0) if warmdown_steps > 0 else 0.0
    out = np.zeros((n, length))
    for i in range(n):
        for j in range(length):
            if mask[i, j]:
                w = min(max(math.exp(np.sign(f[i]) * delta[i, j]), 1 - clip_eps), 1 + clip_eps)
                out[i, j] = a_e[i] + f[i] * ((1 - lam) + lam * w)
    return out, dict(a_e=a_e, a_s=a_s, a_o=a_o, c=c, f=f, lam=lam, rho_hat=rho_hat, c_star=cs)


# ---- GiGPO reductions (the positive controls) ---------------------------------------------------------------------
@SETTINGS
@given(token_batches(), states, params)
def test_no_teacher_signal_is_gigpo_for_any_state_and_lambda(batch, state, p):
    rows, logp_old, _, mask = batch
    steps = table(rows, logp_old, logp_old, mask)  # logp_teacher == logp_old: delta = 0, nobody is taught
    est, out = run(steps, state, **p)
    ref = gigpo_tokens(steps, mask, gamma=p["gamma"], step_weight=p["step_weight"])
    assert torch.allclose(out, ref, rtol=0, atol=1e-5)
    assert est.last_terms.taught.sum() == 0 and torch.all(est.last_terms.c == 1)


@SETTINGS
@given(token_batches(), st.sampled_from([0.5, 1.0]))
def test_lam0_zero_first_batch_is_gigpo_even_with_a_teacher(batch, omega):
    rows, logp_old, logp_teacher, mask = batch
    steps = table(rows, logp_old, logp_teacher, mask)
    est, out = run(steps, lam0=0.0, step_weight=omega)
    # first batch: no measurement yet => rho_hat = 0 => c* = 1 => c = 1 everywhere => F = A^S
    assert est.stats["uniopsd/rho_hat"] == 0.0 and est.stats["uniopsd/c_star"] == 1.0
    assert torch.all(est.last_terms.c == 1)
    assert torch.allclose(out, gigpo_tokens(steps, mask, step_weight=omega), rtol=0, atol=1e-5)
    # the pure fn is that same first batch
    assert torch.equal(steps.to_input_order(mod.uniopsd(steps, mod.UniOPSDParams(lam0=0.0, step_weight=omega))).float(),
                       out)


# ---- invariants on random batches ---------------------------------------------------------------------------------
@SETTINGS
@given(token_batches(), states, params)
def test_bounds_signs_convexity_and_shape_on_random_batches(batch, state, p):
    rows, logp_old, logp_teacher, mask = batch
    steps = table(rows, logp_old, logp_teacher, mask)
    est, out = run(steps, state, **p)
    t = est.last_terms
    m = torch.as_tensor(mask).bool()
    assert out.shape == tuple(mask.shape) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.all(out[~m] == 0)
    # convex fusion: c in [0, 1] and F between A^S and A^O
    assert torch.all((t.c >= 0) & (t.c <= 1))
    lo, hi = torch.minimum(t.a_step, t.a_opsd), torch.maximum(t.a_step, t.a_opsd)
    tol = 1e-9 * (1 + hi.abs())
    assert torch.all((t.fused >= lo - tol) & (t.fused <= hi + tol))
    # Prop. 1: |Ahat - (A^E + F)| <= lambda eps_w |F| on mask tokens (sorted order terms)
    base = (t.a_episode + t.fused)[:, None].expand_as(t.advantage)
    gap = (t.advantage - base).abs()[t.mask]
    bound = (t.lam * p["clip_eps"] * t.fused.abs())[:, None].expand_as(t.advantage)[t.mask]
    assert torch.all(gap <= bound + 1e-9 * (1 + base.abs()[t.mask]))
    # the modulation factor (Ahat - A^E) / F lies in [1 - lambda eps_w, 1 + lambda eps_w] > 0: F keeps its sign ...
    f_tok = t.fused[:, None].expand_as(t.advantage)[t.mask]
    contribution = (t.advantage - t.a_episode[:, None])[t.mask]
    # (A^E + F) - A^E rounds at the scale of |A^E + F|: the ratio is checked where F stands above that rounding,
    # within the rounding's share of |F|
    noise = 1e-9 * (1 + base.abs()[t.mask])
    live = f_tok.abs() > noise
    factor = contribution[live] / f_tok[live]
    slack = noise[live] / f_tok[live].abs()
    width = t.lam * p["clip_eps"]
    assert torch.all((factor >= 1 - width - slack) & (factor <= 1 + width + slack))
    assert torch.all(contribution[f_tok == 0] == 0)
    # ... and sign(Ahat) = sign(A^E + F) wherever A^E + F is farther from 0 than the bound
    clear = base.abs()[t.mask] > bound + 1e-9 * (1 + base.abs()[t.mask])
    assert torch.all(torch.sign(t.advantage[t.mask][clear]) == torch.sign(base[t.mask][clear]))
    # stats are finite plain floats
    assert all(isinstance(v, float) and math.isfinite(v) for v in est.stats.values())


@SETTINGS
@given(token_batches(), states, params)
def test_matches_a_row_by_row_reference(batch, state, p):
    rows, logp_old, logp_teacher, mask = batch
    steps = table(rows, logp_old, logp_teacher, mask)
    est, out = run(steps, state, **p)
    ref, parts = naive_uniopsd(rows, logp_old, logp_teacher, mask, state, **p)
    t = est.last_terms
    back = steps.to_input_order
    assert t.lam == pytest.approx(parts["lam"], abs=1e-15)
    assert t.rho_hat == pytest.approx(parts["rho_hat"], abs=1e-12)
    assert t.c_star == pytest.approx(parts["c_star"], abs=1e-12)
    for name, ours in (("a_e", t.a_episode), ("a_s", t.a_step), ("a_o", t.a_opsd), ("c", t.c), ("f", t.fused)):
        theirs = torch.tensor(parts[name], dtype=torch.float64)
        assert torch.allclose(back(ours), theirs, rtol=1e-7, atol=1e-7), name
    assert torch.allclose(back(t.advantage), torch.from_numpy(ref), rtol=1e-7, atol=1e-7)
    assert torch.allclose(out, torch.from_numpy(ref).float(), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(token_batches(), states, st.randoms(use_true_random=False))
def test_output_follows_the_input_row_order(batch, state, rnd):
    rows, logp_old, logp_teacher, mask = batch
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    _, out = run(table(rows, logp_old, logp_teacher, mask), state)
    _, out_perm = run(table([rows[i] for i in perm], logp_old[perm], logp_teacher[perm], mask[perm]), state)
    assert torch.allclose(out_perm, out[perm], rtol=1e-6, atol=1e-6)


# ---- c* -------------------------------------------------------------------------------------------------------
def test_c_star_endpoints():
    for u in (0.1, 0.5, 0.9):
        assert mod.c_star(0.0, u) == 1.0                      # rho -> 0: pure outcome
        assert mod.c_star(1e-9, u) == pytest.approx(1.0, abs=1e-12)
        # rho^2 -> u: the teacher explains all of A^S's signal. q is capped at u (1 - 1e-6), so
        # u - q = 1e-6 u and u^2 - 2uq + q = u (1 - u) + O(1e-6): c* = 1e-6 u / (1 - u) + O(1e-12) (9e-6 at u = 0.9)
        assert mod.c_star(math.sqrt(u), u) == pytest.approx(0.0, abs=1e-5)
        assert mod.c_star(1.0, u) == pytest.approx(0.0, abs=1e-5)  # rho beyond sqrt(u) is capped there too
    for rho in (0.0, 0.3, 0.7, 1.0):
        assert mod.c_star(rho, 1.0) == 1.0                    # u -> 1: a perfect environment estimate never yields
    assert mod.c_star(0.3, 1 - 1e-9) == pytest.approx(1.0, abs=1e-6)
    # u = 0.5 makes the denominator 0.25: c* = 2 (0.5 - q) = 1 - 2 rho^2
    assert mod.c_star(0.3, 0.5) == pytest.approx(1 - 2 * 0.09, abs=1e-12)
    assert mod.c_star(-0.4, 0.5) == 1.0                        # negative rho is clamped to 0


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 0.99), st.floats(0.0, 1.0))
def test_c_star_is_the_precision_weight_of_the_latent_model(u, frac):
    rho = frac * math.sqrt(u) * 0.999
    # A^S = T + e_S, A^O = a T + e_O, Var(A^S) = Var(A^O) = 1, u = Var(T): a = rho / u,
    # Var(e_S) = 1 - u, Var(e_O) = 1 - a^2 u = 1 - rho^2 / u; c* = prec_S / (prec_S + a^2 prec_O)
    a = rho / u
    prec_s, prec_o = 1 / (1 - u), 1 / (1 - rho * rho / u)
    expected = prec_s / (prec_s + a * a * prec_o)
    assert mod.c_star(rho, u) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # and it falls as rho grows
    assert mod.c_star(rho * 0.5, u) >= mod.c_star(rho, u) - 1e-15


def test_shrunk_rho_and_lambda_schedule():
    assert mod.shrunk_rho(None, 50, 0.9, 2.33) == 0.0
    # n = 10 * 1/(1 - 0.9) = 100, se = 0.1: 0.533 - 2.33 * 0.1 = 0.3
    assert mod.shrunk_rho(0.533, 10, 0.9, 2.33) == pytest.approx(0.3, abs=1e-12)
    assert mod.shrunk_rho(0.1, 10, 0.9, 2.33) == 0.0           # shrunk below 0 => 0
    assert mod.shrunk_rho(0.4, 0, 0.0, 0.0) == 0.4              # n_prev 0 counts as 1; decay 0 gives n_eff = n
    # lambda_m = 0.5 (1 - m / 100)
    assert mod.lambda_at(1, 0.5, 100) == pytest.approx(0.495)
    assert mod.lambda_at(50, 0.5, 100) == pytest.approx(0.25)
    assert mod.lambda_at(100, 0.5, 100) == 0.0 and mod.lambda_at(250, 0.5, 100) == 0.0
    assert mod.lambda_at(0, 0.5, 0) == 0.0 and mod.lambda_at(3, 0.5, 0) == 0.0


def test_lambda_follows_the_batch_counter():
    steps = hand_table()
    est = mod.ESTIMATOR.create(warmdown_steps=4)
    lams = []
    for _ in range(6):
        est(steps)
        lams.append(est.stats["uniopsd/lambda"])
    # m = 1..6: 0.5 (1 - m/4) = 0.375, 0.25, 0.125, 0, 0, 0 (verl's global_steps start at 1)
    assert lams == pytest.approx([0.375, 0.25, 0.125, 0.0, 0.0, 0.0], abs=1e-15)
    assert est.state_dict()["step"] == 6


# ---- hand-computed batch ------------------------------------------------------------------------------------------
HAND = {"a": (True, ["s0", "s1"]), "b": (False, ["s0", "s1"]), "c": (False, ["s0", "s2"])}
# teacher gap per row on the two mask tokens (the third token is padding, NaN in logp_old)
HAND_DELTA = {("a", 0): [0, 0], ("a", 1): [0, 0], ("b", 0): [0.2, 0.0], ("b", 1): [-0.3, -0.1],
              ("c", 0): [0.5, 0.1], ("c", 1): [-0.1, -0.1]}


def hand_table():
    rows = rows_of(HAND)
    logp_old = np.full((len(rows), 3), -1.0)
    logp_teacher = logp_old.copy()
    for i, r in enumerate(rows):
        logp_teacher[i, :2] += HAND_DELTA[(r["traj"], r["t"])]
    logp_old[:, 2] = np.nan
    mask = np.array([[1, 1, 0]] * len(rows))
    return table(rows, logp_old, logp_teacher, mask)


def test_hand_computed_batch():
    # rows (input order): a0 a1 b0 b1 c0 c1; a succeeds (r = 10 at t = 1), b and c fail; gamma 0.95
    # R_t: a0 9.5, a1 10, all others 0.   anchor groups: s0 {a0, b0, c0}, s1 {a1, b1}, s2 {c1} (singleton)
    # A^E (steps, mean_norm): row returns [10, 10, 0, 0, 0, 0], mean 10/3 -> a: 20/3, b, c: -10/3
    # A^S: s0 mean 19/6 -> a0 19/3, b0 = c0 = -19/6;  s1 mean 5 -> a1 5, b1 -5;  s2: 0
    # dbar: b0 0.1, b1 -0.2, c0 0.3, c1 -0.1 (a: 0);  Var_t: b0 0.01, b1 0.01, c0 0.04, c1 0
    # d = dbar - anchor mean: s0 mean 0.4/3 -> a0 -2/15, b0 -1/30, c0 1/6;  s1 mean -0.1 -> a1 0.1, b1 -0.1;  c1 0
    # taught T = {b0, b1, c0, c1}: d_T = (-1/30, -1/10, 1/6, 0), mean 1/120, deviations (-5, -13, 19, -1)/120:
    #   std_T(d) = sqrt(556/14400/3) = 0.1134477;  std_T(A^S) = std(-19/6, -5, -19/6, 0) = sqrt(466/36/3) = 2.0772132
    #   s = 2.0772132 / (0.1134477 + 1e-6) = 18.309721, s^2 = 335.2459
    # A^O = s d: a0 -2.441296, b0 -0.610324, c0 3.051620, a1 1.830972, b1 -1.830972, c1 0
    # has_step: s0, s1 rows;  both = {b0, b1, c0};  vacuum = {c1};  untaught = {a0, a1}
    # p^S: s0 3 / var(9.5, 0, 0) = 3 / 30.08333 = 0.0997230;  s1 2 / 50 = 0.04
    #   median_both (b0, b1, c0) = 0.0997230 -> z^S: b0 1, b1 0.401111, c0 1
    # p^O = 1/(Var_t/2 s^2): b0, b1 1/1.676229 = 0.596577;  c0 1/6.704918 = 0.149144
    #   median_both = 0.596577 -> z^O: b0 1, b1 1, c0 0.25
    # state rhobar 0.533, n_prev 10: rho_hat = 0.533 - 2.33/sqrt(10 * 10) = 0.3;  q = 0.09
    #   c* = 0.5 (0.5 - 0.09) / (0.25 - 0.09 + 0.09) = 0.82;  a = 0.82/0.18 = 41/9
    # c: b0 (41/9)/(41/9 + 1) = 0.82;  b1 (41/9 0.401111)/(41/9 0.401111 + 1) = 0.646304;
    #    c0 (41/9)/(41/9 + 0.25) = 0.947977;  c1 = c* = 0.82;  a0 = a1 = 1
    # F: a0 19/3, a1 5, b0 0.82 (-19/6) + 0.18 (-0.610324) = -2.706525,
    #    b1 0.646304 (-5) + 0.353696 (-1.830972) = -3.879126, c0 0.947977 (-19/6) + 0.052023 (3.051620) = -2.843172,
    #    c1 0.18 * 0 = 0
    # lambda_1 = 0.5 (1 - 1/100) = 0.495;  factor = 0.505 + 0.495 w
    # w: a rows 1 (delta 0); b0: exp(-0.2) = 0.818731, 1; b1: exp(0.3) = 1.349859 -> 1.2, exp(0.1) = 1.105171;
    #    c0: exp(-0.5) = 0.606531 -> 0.8, exp(-0.1) = 0.904837; c1: sign(F) = 0 -> 1
    expected = [
        [20 / 3 + 19 / 3, 13.0],                                                         # a0
        [20 / 3 + 5, 20 / 3 + 5],                                                        # a1
        [-10 / 3 - 2.706525 * (0.505 + 0.495 * 0.818731), -10 / 3 - 2.706525],           # b0: -5.797007, -6.039858
        [-10 / 3 - 3.879126 * (0.505 + 0.495 * 1.2), -10 / 3 - 3.879126 * (0.505 + 0.495 * 1.105171)],  # b1
        [-10 / 3 - 2.843172 * (0.505 + 0.495 * 0.8), -10 / 3 - 2.843172 * (0.505 + 0.495 * 0.904837)],  # c0
        [-10 / 3, -10 / 3],                                                              # c1
    ]
    est = mod.ESTIMATOR.create()
    est.load_state_dict({"step": 0, "rho_ema": 0.533, "n_prev": 10})
    out = est(hand_table())
    assert out[:, :2].reshape(-1).tolist() == pytest.approx(sum(expected, []), abs=2e-5)
    assert torch.all(out[:, 2] == 0)
    t = est.last_terms
    back = hand_table().to_input_order
    assert t.scale == pytest.approx(18.309721, abs=1e-5)
    assert back(t.c).tolist() == pytest.approx([1, 1, 0.82, 0.646304, 0.947977, 0.82], abs=1e-6)
    assert back(t.a_opsd).tolist() == pytest.approx([-2.441296, 1.830972, -0.610324, -1.830972, 3.051620, 0],
                                                    abs=1e-5)
    # diagnostics: both 3/6; sign(A^S) = (-, -, -) vs sign(A^O) = (-, -, +): 1 of 3 differs;
    # c_mean = (1 + 1 + 0.82 + 0.646304 + 0.947977 + 0.82)/6 = 0.872380; mid (0.1 < c < 0.9): 0.82, 0.646, 0.82;
    # saturated tokens: b1 tok 1 and c0 tok 1 of 12; teacher_kl = -(0.2 - 0.4 + 0.6 - 0.2)/12 = -0.2/12
    s = est.stats
    assert s["uniopsd/both_coverage"] == 0.5 and s["uniopsd/sign_disagree"] == pytest.approx(1 / 3)
    assert s["uniopsd/c_mean"] == pytest.approx(0.872380, abs=1e-6) and s["uniopsd/c_frac_mid"] == 0.5
    assert s["uniopsd/clip_saturation_frac"] == pytest.approx(1 / 6) and s["uniopsd/dead_token_frac"] == 0.0
    assert s["uniopsd/teacher_kl"] == pytest.approx(-0.2 / 12, abs=1e-6)
    assert s["uniopsd/gap_abs_mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.2) / 12, abs=1e-6)
    assert s["uniopsd/rho_hat"] == pytest.approx(0.3) and s["uniopsd/c_star"] == pytest.approx(0.82)
    assert s["uniopsd/lambda"] == pytest.approx(0.495) and s["uniopsd/taught_frac"] == pytest.approx(4 / 6)
    # rho update on both rows: A^S (-19/6, -5, -19/6) centred ~ (1, -2, 1); A^O ~ d = (-1/30, -1/10, 1/6) ~ (-1, -3, 5)
    #   centred ~ (-2, -5, 7): corr = (-2 + 10 + 7) / sqrt(6 * 78) = 15/sqrt(468) = 0.693375
    #   rhobar = 0.9 * 0.533 + 0.1 * 0.693375 = 0.549038, n_prev = 3
    assert s["uniopsd/corr"] == pytest.approx(HAND_CORR, abs=1e-9)
    assert est.state_dict() == {"step": 1, "rho_ema": pytest.approx(0.9 * 0.533 + 0.1 * HAND_CORR), "n_prev": 3}


HAND_CORR = 15 / math.sqrt(468)


def test_hand_batch_from_a_fresh_state_is_teacher_off_and_starts_the_ema():
    est = mod.ESTIMATOR.create()
    out = est(hand_table())
    # c* = 1: F = A^S, w keys off sign(A^S): b0 (A^S < 0) tok 1: exp(-0.2); c1 (A^S = 0): w = 1
    assert out[2, 0].item() == pytest.approx(-10 / 3 - 19 / 6 * (0.505 + 0.495 * math.exp(-0.2)), abs=1e-5)
    assert out[5].tolist() == pytest.approx([-10 / 3, -10 / 3, 0.0], abs=1e-6)
    # the correlation is measured on the same rows (A^O does not depend on c): rhobar = 15/sqrt(468), n_prev 3
    assert est.state_dict() == {"step": 1, "rho_ema": pytest.approx(HAND_CORR), "n_prev": 3}
    # next batch: rho_hat = 0.693375 - 2.33 / sqrt(3 * 10) = 0.267979
    est(hand_table())
    assert est.stats["uniopsd/rho_hat"] == pytest.approx(HAND_CORR - 2.33 / math.sqrt(30), abs=1e-9)


def test_frozen_rho_fixes_the_trust_while_the_ema_advances():
    est = mod.ESTIMATOR.create(frozen_rho=0.25)
    est(hand_table())
    # u = 0.5: c* = 1 - 2 * 0.0625 = 0.875 from the first batch on
    assert est.stats["uniopsd/c_star"] == pytest.approx(0.875) and est.stats["uniopsd/rho_hat"] == 0.25
    assert est.state_dict()["rho_ema"] == pytest.approx(HAND_CORR)


# ---- edge cases -----------------------------------------------------------------------------------------------
def test_all_fail_groups_get_zero_advantage_without_division_by_zero():
    rows = rows_of({"a": (False, ["s0", "s1"]), "b": (False, ["s0", "s1"]), "c": (False, ["s0"])})
    rows += rows_of({"x": (True, ["s0", "s1"]), "y": (False, ["s0", "s2"])}, group="h")
    n = len(rows)
    rng = np.random.default_rng(0)
    logp_old = -rng.exponential(1.0, (n, 3))
    logp_teacher = logp_old.copy()
    fail_g = np.array([r["group"] == "g" for r in rows])
    y = np.array([r["traj"] == "y" for r in rows])
    logp_teacher[y] += rng.normal(0, 0.3, (int(y.sum()), 3))       # only y (failed, group h has a success) is taught
    steps = table(rows, logp_old, logp_teacher, np.ones((n, 3)))
    for state in (None, {"step": 5, "rho_ema": 0.9, "n_prev": 40}):
        _, out = run(steps, state, rho_shrink_z=0.0)
        assert torch.isfinite(out).all()
        assert torch.all(out[torch.from_numpy(fail_g)] == 0)
    # a batch of all-fail groups only: everything is 0, stats finite
    only = [r for r in rows if r["group"] == "g"]
    est, out = run(table(only, logp_old[fail_g], logp_old[fail_g], np.ones((len(only), 3))))
    assert torch.all(out == 0) and all(math.isfinite(v) for v in est.stats.values())
    assert est.stats["uniopsd/dead_token_frac"] == 1.0 and est.stats["uniopsd/corr_measured"] == 0.0
    assert est.state_dict()["rho_ema"] is None                   # nothing measured, nothing stored


def test_a_row_without_mask_tokens_is_zero_and_untaught():
    steps = hand_table()
    mask = np.array([[1, 1, 0]] * 6)
    mask[3] = 0                                                   # b1 has no trainable token
    logp_old, logp_teacher = steps.extra("logp_old")[steps.inverse], steps.extra("logp_teacher")[steps.inverse]
    steps2 = table(rows_of(HAND), logp_old, logp_teacher, mask)
    est, out = run(steps2, {"step": 0, "rho_ema": 0.533, "n_prev": 10})
    assert torch.all(out[3] == 0)
    assert not bool(steps2.to_input_order(est.last_terms.taught)[3])
    assert torch.isfinite(out).all()


def test_constant_anchor_group_has_no_step_evidence():
    # b and c both fail through s0 -> s2: the s2 anchor group {b1, c1} has returns (0, 0): no step evidence,
    # A^S = 0 exactly, both rows are vacuum (taught, no step evidence) and get c = c*
    spec = {"a": (True, ["s0", "s1"]), "b": (False, ["s0", "s2"]), "c": (False, ["s0", "s2"])}
    rows = rows_of(spec)
    logp_old = np.full((6, 2), -1.0)
    logp_teacher = logp_old + np.array([[0, 0], [0, 0], [0.3, 0.1], [0.2, -0.2], [-0.1, 0.0], [0.4, 0.2]])
    est, _ = run(table(rows, logp_old, logp_teacher, np.ones((6, 2))), {"step": 0, "rho_ema": 0.6, "n_prev": 100},
                 rho_shrink_z=0.0)
    t, back = est.last_terms, table(rows, logp_old, logp_teacher, np.ones((6, 2))).to_input_order
    assert back(t.has_step).tolist() == [True, False, True, False, True, False]
    assert torch.all(back(t.a_step)[[1, 3, 5]] == 0)
    assert back(t.c)[[3, 5]].tolist() == pytest.approx([t.c_star, t.c_star])
    assert t.c_star == pytest.approx(1 - 2 * 0.36)
    # vacuum rows in a multi-row anchor group carry the teacher's estimate: F = (1 - c*) A^O != 0
    f, a_o = back(t.fused), back(t.a_opsd)
    assert f[[3, 5]].tolist() == pytest.approx((0.72 * a_o[[3, 5]]).tolist()) and torch.all(f[[3, 5]] != 0)
    assert est.stats["uniopsd/opsd_rescue_frac"] == pytest.approx(2 / 6)


def test_rounding_noise_of_a_constant_anchor_group_is_not_step_evidence():
    # six rollouts s -> e_i, each paid 0.7 at t = 1: R_0 = 0.95 * 0.7 for all six. GiGPO's mean of six equal
    # float64 values is off by one ulp, so its A^S there is ~1e-16, not 0; UniOPSD's is 0 and the rows are vacuum
    spec = {f"r{i}": (False, ["s", f"e{i}"]) for i in range(6)}
    rows = rows_of(spec)
    for r in rows:
        r["reward"] = 0.7 if r["t"] == 1 else 0.0
    rng = np.random.default_rng(1)
    logp_old = -rng.exponential(1.0, (12, 2))
    steps = table(rows, logp_old, logp_old + rng.normal(0, 0.2, (12, 2)), np.ones((12, 2)))
    s_rows = steps.t == 0
    ref = gigpo_mod.step_advantage(steps, gamma=0.95, norm_std=False, eps=1e-6)
    assert bool((ref[s_rows] != 0).any())                      # the noise this guards against
    est, _ = run(steps, {"step": 0, "rho_ema": 0.6, "n_prev": 100}, rho_shrink_z=0.0)
    t = est.last_terms
    assert torch.all(t.a_step == 0) and not bool(t.has_step.any())
    assert torch.all(t.c[t.taught] == t.c_star)                # vacuum rows get c*, not a precision-driven c ~ 1


# ---- state ----------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(token_batches(), token_batches())
def test_state_dict_round_trip_equals_an_uninterrupted_run(b1, b2):
    t1, t2 = table(*b1), table(*b2)
    p = dict(rho_shrink_z=0.5)
    run_a = mod.ESTIMATOR.create(**p)
    run_a(t1)
    out_a = run_a(t2)
    first = mod.ESTIMATOR.create(**p)
    first(t1)
    saved = first.state_dict()
    assert all(v is None or isinstance(v, (int, float)) for v in saved.values())
    resumed = mod.UniOPSD(**p)
    resumed.load_state_dict(saved)
    out_b = resumed(t2)
    assert torch.equal(out_a, out_b) and resumed.state_dict() == run_a.state_dict()
    assert resumed.stats == run_a.stats


def test_state_advances_and_resets():
    est = mod.UniOPSD()
    est(hand_table())
    est(hand_table())
    s = est.state_dict()
    # batch 2: rhobar = 0.9 corr + 0.1 corr = corr (the same batch measures the same correlation)
    assert s["step"] == 2 and s["rho_ema"] == pytest.approx(HAND_CORR) and s["n_prev"] == 3
    est.reset()
    assert est.state_dict() == {"step": 0, "rho_ema": None, "n_prev": 0}


# ---- bad input --------------------------------------------------------------------------------------------------
def bad_table(**override):
    steps = hand_table()
    ex = {k: steps.extra(k)[steps.inverse] for k in mod.EXTRAS}
    ex.update(override)
    ex = {k: v for k, v in ex.items() if v is not None}
    return cp.StepTable(**columns(rows_of(HAND)), extras=ex)


@pytest.mark.parametrize("override, match", [
    ({"logp_teacher": None}, r"needs StepTable field\(s\) \['logp_teacher'\]"),
    ({"response_mask": None}, r"needs StepTable field\(s\) \['response_mask'\]"),
    ({"logp_old": torch.zeros(6)}, r"extras\['logp_old'\] has shape \(6,\); UniOPSD needs \[S, L\]"),
    ({"logp_teacher": torch.zeros(6, 2)}, r"extras\['logp_teacher'\] has shape \(6, 2\) but extras\['logp_old'\] has "
                                        r"\(6, 3\)"),
    ({"response_mask": torch.ones(6, 4)}, r"extras\['response_mask'\] has shape \(6, 4\)"),
    ({"response_mask": torch.full((6, 3), 2.0)}, r"extras\['response_mask'\] has 18 value\(s\) other than 0/1"),
    ({"response_mask": torch.full((6, 3), float("nan"))}, r"response_mask'\] has 18 value\(s\) other than 0/1"),
    ({"logp_old": torch.full((6, 3), float("nan"))}, r"extras\['logp_old'\] has 12 NaN/inf value\(s\) on mask tokens"),
    ({"logp_teacher": torch.full((6, 3), float("inf"))}, r"extras\['logp_teacher'\] has 12 NaN/inf value\(s\) on mask"),
])
def test_bad_extras_raise_naming_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        mod.ESTIMATOR.create()(bad_table(**override))


def test_missing_state_and_stateful_call_raise():
    steps = hand_table()
    ex = {k: steps.extra(k)[steps.inverse] for k in mod.EXTRAS}
    cols = columns(rows_of(HAND))
    del cols["state"]
    with pytest.raises(ValueError, match=r"needs StepTable field\(s\) \['state'\]"):
        mod.UniOPSD()(cp.StepTable(**cols, extras=ex))
    with pytest.raises(ValueError, match=r"estimator 'uniopsd' keeps state across batches"):
        mod.ESTIMATOR(steps)


@pytest.mark.parametrize("values, match", [
    ({"gamma": 1.5}, r"gamma=1.5; the discount must lie in \[0, 1\]"),
    ({"a_reliability": 0.0}, r"a_reliability=0.0; u is a reliability in \(0, 1\]"),
    ({"a_reliability": 1.2}, r"a_reliability=1.2"),
    ({"rho_decay": 1.0}, r"rho_decay=1.0; the EMA decay must lie in \[0, 1\)"),
    ({"rho_shrink_z": -1.0}, r"rho_shrink_z=-1.0; kappa must be finite and >= 0"),
    ({"lam0": 2.0}, r"lam0=2.0; lambda_0 must lie in \[0, 1\]"),
    ({"clip_eps": 1.0}, r"clip_eps=1.0; eps_w must lie in \[0, 1\)"),
    ({"eps": 0.0}, r"eps=0.0; it must be > 0"),
    ({"warmdown_steps": -1}, r"warmdown_steps=-1; give the number of batches"),
    ({"warmdown_steps": 2.5}, r"warmdown_steps=2.5"),
    ({"episode_stats": "rows"}, r"episode_stats='rows'; choose one of"),
    ({"frozen_rho": 1.5}, r"frozen_rho=1.5; use None"),
    ({"step_weight": float("nan")}, r"step_weight=nan: must be a finite number"),
    ({"peer_success_threshold": float("inf")}, r"peer_success_threshold=inf"),
    ({"lambda0": 0.5}, r"unknown parameter\(s\) \['lambda0'\]"),
])
def test_bad_params_raise_naming_the_field(values, match):
    with pytest.raises(ValueError, match=match):
        mod.ESTIMATOR.create(**values)


@pytest.mark.parametrize("state, match", [
    ({"step": 0, "rho_ema": None}, r"missing keys \['n_prev'\]"),
    ({"step": 0, "rho_ema": None, "n_prev": 0, "kappa": 1}, r"unexpected keys \['kappa'\]"),
    ({"step": -1, "rho_ema": None, "n_prev": 0}, r"step=-1: must lie in \[0, "),
    ({"step": 0, "rho_ema": 2.0, "n_prev": 0}, r"rho_ema=2.0: must lie in \[-1.0, 1.0\]"),
    ({"step": 0, "rho_ema": "0.3", "n_prev": 0}, r"rho_ema='0.3'"),
    ({"step": 0, "rho_ema": None, "n_prev": 1.5}, r"n_prev=1.5: must be an integer"),
])
def test_bad_state_raises(state, match):
    with pytest.raises(ValueError, match=match):
        mod.UniOPSD().load_state_dict(state)


def test_params_and_keywords_together_raise():
    with pytest.raises(ValueError, match="either a UniOPSDParams or keyword parameters"):
        mod.UniOPSD(mod.UniOPSDParams(), lam0=0.1)


def test_estimator_record():
    e = mod.ESTIMATOR
    assert e.name == "uniopsd" and e.output == "token" and e.stateful is mod.UniOPSD
    assert e.required_fields == ("state", "logp_old", "logp_teacher", "response_mask")
    assert "Ahat_kt" in e.formula and "c*" in e.formula and "arXiv:2609.34810" in e.paper
    d = e.defaults()
    assert d["gamma"] == 0.95 and d["norm_std"] is False and d["a_reliability"] == 0.5 and d["rho_decay"] == 0.9
    assert d["rho_shrink_z"] == 2.33 and d["lam0"] == 0.5 and d["warmdown_steps"] == 100 and d["clip_eps"] == 0.2
    assert d["frozen_rho"] is None and d["episode_stats"] == "steps" and d["step_weight"] == 1.0


# ---- hindsight helpers ----------------------------------------------------------------------------------------
def peer_table(trajs, returns, groups, ts=None):
    ts = ts if ts is not None else [0] * len(trajs)
    reward = [returns[k] if t == max(tt for kk, tt in zip(trajs, ts) if kk == k) else 0.0
              for k, t in zip(trajs, ts)]
    return cp.StepTable(group=groups, traj=trajs, t=ts, reward=reward)


def dense(steps, key):
    """dense trajectory id of the traj key `key`"""
    return int(steps.row_traj[(steps.traj == key).nonzero()[0]])


def test_choose_peers_first_appearance_not_key_order():
    # input rows: traj 5 (success) at rows 0, 3; traj 2 (success) at rows 1, 2; traj 7 (fail) at row 4
    steps = peer_table([5, 2, 2, 5, 7], {5: 10.0, 2: 10.0, 7: 0.0}, ["g"] * 5, ts=[0, 1, 0, 1, 0])
    peer = choose_peers(steps)
    assert peer[dense(steps, 7)] == dense(steps, 5)           # 5 appears first, though 2 < 5 and 2 sorts first
    assert peer[dense(steps, 5)] == -1 and peer[dense(steps, 2)] == -1   # successes are not taught
    # traj 2's t=1 row now comes first in the input: 2 is the peer
    steps = peer_table([2, 5, 2, 5, 7], {5: 10.0, 2: 10.0, 7: 0.0}, ["g"] * 5, ts=[1, 0, 0, 1, 0])
    assert choose_peers(steps)[dense(steps, 7)] == dense(steps, 2)


def test_choose_peers_all_fail_groups_and_threshold():
    steps = peer_table([0, 1, 2, 3, 4], {0: 0.0, 1: -0.1, 2: 0.5, 3: 10.0, 4: 0.0}, ["a", "a", "b", "b", "b"])
    peer = choose_peers(steps)
    assert peer.dtype == torch.int64 and peer.shape == (5,)
    assert peer[dense(steps, 0)] == -1 and peer[dense(steps, 1)] == -1       # all-fail group: no teacher
    assert peer[dense(steps, 2)] == dense(steps, 3)                          # 0.5 < 1.0 is a failure
    assert peer[dense(steps, 4)] == dense(steps, 3) and peer[dense(steps, 3)] == -1
    peer = choose_peers(steps, success_threshold=0.5)                        # now 2 succeeds, and comes first
    assert peer[dense(steps, 4)] == dense(steps, 2) and peer[dense(steps, 3)] == -1
    with pytest.raises(ValueError, match=r"success_threshold=nan; pass the episode return"):
        choose_peers(steps, success_threshold=float("nan"))


def naive_peers(rows, threshold):
    """the authors' loop: trajectories registered in input order, per group the first with return >= threshold"""
    ret, group, order = defaultdict(float), {}, defaultdict(list)
    for r in rows:
        ret[r["traj"]] += float(np.float32(r["reward"]))
        if r["traj"] not in group:
            group[r["traj"]] = r["group"]
            order[r["group"]].append(r["traj"])
    chosen = {g: next((k for k in ks if ret[k] >= threshold), None) for g, ks in order.items()}
    return {k: None if ret[k] >= threshold else chosen[group[k]] for k in group}


@settings(max_examples=50, deadline=None)
@given(step_batches(max_groups=4, max_rollouts=6, max_len=4), st.sampled_from([1.0, 0.0, -0.05]))
def test_choose_peers_matches_the_authors_loop(rows, threshold):
    for r in rows:
        r["traj"] = int(r["traj"][3:])       # integer keys are kept as they are, so dense id -> key is readable
    steps = cp.StepTable(**columns(rows))
    peer = choose_peers(steps, success_threshold=threshold)
    key = steps.traj[steps.first_row]        # [N] traj key of each dense id
    expected = naive_peers(rows, threshold)
    got = {int(key[k]): None if int(peer[k]) < 0 else int(key[int(peer[k])]) for k in range(steps.n_traj)}
    assert got == expected


def test_peer_prefix_exact_text():
    assert peer_prefix(["go to desk 1", "take mug 1 from desk 1"]) == (
        HEADER + "1. go to desk 1\n2. take mug 1 from desk 1\n\n")
    assert hindsight.PEER_HINDSIGHT_HEADER == HEADER
    # empty / None actions are skipped (a turn without a parsable action), numbering stays consecutive
    assert peer_prefix(["look", "", None, "  open drawer 2 "]) == HEADER + "1. look\n2. open drawer 2\n\n"
    assert peer_prefix([]) == "" and peer_prefix(["", None]) == ""   # no action at all: no teacher
    assert peer_prefix(["a", "b", "c"], max_steps=2) == HEADER + "1. b\n2. c\n\n"
    with pytest.raises(ValueError, match="not a single string"):
        peer_prefix("go north")
    with pytest.raises(ValueError, match=r"max_steps=-1; use 0 to keep every action"):
        peer_prefix(["a"], max_steps=-1)


def test_last_action():
    assert last_action("<think>hmm</think><action> go to desk 1 </action>") == "go to desk 1"
    assert last_action("<action>a</action> then <action>\ntake mug\n</action>") == "take mug"
    assert last_action("no tags here") is None and last_action("<action>unclosed") is None
    assert last_action("<action></action>") == ""
    # a second opening tag before the close: the span starts at the last one
    assert last_action("<action>" + "<action>look</action>") == "look"
    # Search-QA fallback keeps the tags; hide_answer drops <answer> spans
    assert last_action("<search> capital of Germany </search>") == "<search>capital of Germany</search>"
    assert last_action("<search>q</search><answer>Bonn</answer>") == "<answer>Bonn</answer>"
    assert last_action("<search>q</search><answer>Bonn</answer>", hide_answer=True) == "<search>q</search>"
    assert last_action("<answer>Bonn</answer>", hide_answer=True) is None
    assert last_action("<search>q</search><action>go</action>") == "go"   # <action> wins when present
