"""Loop references of the credit estimators: for each vectorised estimator in :mod:`credit_plugins.estimators`, a
plain implementation (Python loops over rows and groups, dicts keyed by trajectory and state) that reads like the
paper. Each is wired into its estimator's record (``Estimator.reference``), so ``cp.get(name).reference_values(steps,
**params)`` gives the reference's answer; tests compare the two on random batches, ``benchmarks/credit_speed.py``
times the vectorised code against them. Never used for training: they are slow by design.
"""
