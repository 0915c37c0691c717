import os
import sys

# tests/ itself (launch helpers) and tests/parallel (per-rank helpers) on sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
collect_ignore = ["parallel", "scripts"]
