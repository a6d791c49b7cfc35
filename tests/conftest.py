import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # benchmarks/ holds the naive reference implementations used as oracles
    sys.path.insert(0, ROOT)
