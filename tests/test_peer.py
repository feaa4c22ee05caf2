"""bench/peer.py's reading of timm's train.py log: each update's own rate, warm-up updates skipped."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("peer", Path(__file__).parents[1] / "bench" / "peer.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)

LOG = """Training with a single process on 1 device (cpu).
Train: 0 [   0/4 ( 25%)]  Loss: 2.41 (2.41)  Time: 1.512s,   10.58/s  (1.512s,   10.58/s)  LR: 1.000e-01
Train: 0 [   1/4 ( 50%)]  Loss: 2.38 (2.40)  Time: 0.640s,   25.00/s  (1.076s,   14.87/s)  LR: 1.000e-01
Train: 0 [   2/4 ( 75%)]  Loss: 2.35 (2.38)  Time: 0.500s,   32.00/s  (0.884s,   18.10/s)  LR: 1.000e-01
Train: 0 [   3/4 (100%)]  Loss: 2.33 (2.37)  Time: 0.400s,   40.00/s  (0.763s,   20.97/s)  LR: 1.000e-01
"""


def test_timm_rates_are_each_updates_own_after_the_warm_up():
    """The update's rate (`25.00/s`), not the running average in brackets, from update `warmup` on."""
    assert peer.timm_rates(LOG, warmup=0) == [10.58, 25.0, 32.0, 40.0]
    assert peer.timm_rates(LOG, warmup=2) == [32.0, 40.0]
    assert peer.timm_rates("no training here", warmup=0) == []


def test_the_ratios_spread_is_their_interquartile_range():
    assert peer.quartiles([1.1]) == (1.1, 1.1)
    assert peer.quartiles([1.0, 1.1, 1.2, 1.3, 1.4]) == (1.1, 1.3)
