"""Loaded by Python at start-up on the ranks of ``aiakrun --advise`` (and only there: this
folder is on their PYTHONPATH for that run alone): profile the script's optimizer."""
from aiak_training.advisor.trace import install

install()
