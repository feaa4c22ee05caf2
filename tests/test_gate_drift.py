"""The gate never favours the erratic, and bounds the drift: simulated weeks through `judge` itself
(`cnnpipe.release.simulate`), seeded, with common random numbers between the cells of a grid so that
neighbouring cells differ only by what the cell changes. bench/gate_power.py prints the full tables."""

import numpy as np

from cnnpipe.release.gate import GateRules, judge
from cnnpipe.release.simulate import one_week, run_weeks

WEEKS = 100
TOLERANCE = 5.0  # points: Monte Carlo noise between neighbouring cells of 100 weeks with shared draws


def bless_rates(n: int, k: int, loss: float, flips_grid: tuple[float, ...], rules: GateRules) -> list[float]:
    """% of `WEEKS` simulated weeks blessed at each discordance, the same draws for every discordance."""
    recall = np.random.default_rng([1, k]).uniform(0.60, 0.94, k)
    rates = []
    for flips in flips_grid:
        rng = np.random.default_rng([7, n, k])
        blessed = sum(one_week(n, k, recall, flips, loss, rng.random((2, n)), rules)["blessed"] for _ in range(WEEKS))
        rates.append(100.0 * blessed / WEEKS)
    return rates


def test_the_bless_rate_never_rises_with_the_discordance_at_a_fixed_true_loss():
    """2,000 test images in 20 classes, a challenger 0 to 3 points worse in every class, disagreeing with
    the champion on 4% to 16% of the images. Before, a 1.5-point loss was blessed 0% of weeks at 4% and
    93% at 12% (a noisier challenger escaped through "too small to judge"). The top-1 rules (the week's
    margin and the drift budget) are judged alone here (no class has `min_support` images): at every
    loss within the 3-point budget, more disagreement never raises the chance of a blessing. At the budget
    and beyond it (3 and 4 points) a lower bound is passed by chance at most 1 - drift_confidence (20%) of
    the weeks, whatever the disagreement (the week's bound; the drift bound, spent over 12 weeks, passes fewer)."""
    rules = GateRules(floors={}, min_support=10**9)
    flips = (0.04, 0.08, 0.12, 0.16)
    for loss in (0.0, 0.01, 0.015, 0.02, 0.025):
        rates = bless_rates(2000, 20, loss, flips, rules)
        assert all(later <= earlier + TOLERANCE for earlier, later in zip(rates, rates[1:])), (loss, rates)
    for loss in (0.03, 0.04):
        rates = bless_rates(2000, 20, loss, flips, rules)
        assert max(rates) <= 100 * (1 - rules.drift_confidence) + TOLERANCE, (loss, rates)


def test_the_reported_case_with_every_rule_no_longer_favours_the_noisier_challenger():
    """The same 2,000 images in 20 classes with the default rules (the per-class rule included), 1.5 points
    worse: 12% disagreement is blessed no more often than 4%."""
    low, high = bless_rates(2000, 20, 0.015, (0.04, 0.12), GateRules(floors={}))
    assert high <= low + TOLERANCE, (low, high)


def test_weeks_in_a_row_each_a_point_worse_are_refused_before_their_sum_passes_three_points():
    """1,000 test images in 10 classes, each week's challenger trained from the champion, 1 point worse and
    disagreeing on 6%: each week alone is too small to judge, and the drift from the anchor adds up.
    In at least 90% of 200 runs a week is refused while the shipped loss is at most 3 points (the fourth
    challenger, which would make it 4, is refused if none before was), and no run ships more."""
    rules = GateRules(floors={})
    recall = np.random.default_rng([2, 10]).uniform(0.60, 0.94, 10)
    runs = [run_weeks(1000, 0, 10, recall, 0.06, 0.01, 4, rules, np.random.default_rng([3, r])) for r in range(200)]
    refused = [run.first_refusal is not None for run in runs]
    assert np.mean(refused) >= 0.90, np.mean(refused)
    assert all(run.shipped_loss[-1] <= 0.03 + 1e-9 for run, r in zip(runs, refused) if r)


RETRY_SIZES = (200, 1_000, 5_000)


def retrying_runs(n: int, loss: float, rules: GateRules, runs: int) -> list:
    """`runs` 12-week runs of a loop that retries: every week a challenger trained from the champion,
    `loss` worse and disagreeing on 6%, whether last week's was refused or not; 10 classes, the test set
    growing by a tenth of its first size a week (bench/gate_power.py's weeks in a row)."""
    recall = np.random.default_rng([4, 10]).uniform(0.60, 0.94, 10)
    return [run_weeks(n, n // 10, 10, recall, 0.06, loss, 12, rules, np.random.default_rng([5, n, r]),
                      stop_at_refusal=False) for r in range(runs)]


def within_budget(runs: list, budget: float) -> float:
    """The share of runs whose model in production never lost more than `budget` against week 0's."""
    return float(np.mean([max(run.shipped_loss) <= budget + 1e-9 for run in runs]))


def test_a_loop_that_retries_every_refused_week_stays_within_the_drift_budget():
    """The drift promise with retries: at 200, 1,000 and 5,000 test images, weeks 0.5 and 2 points worse,
    the model in production stays within the 3-point budget in at least 90% of 20 runs of 12 weeks each
    (bench/gate_power.py: 96% or more in 200 runs a cell). The drift bound spends 10% over 12 weeks
    (99.17% a week). With the old bound, 80% a week (drift_weeks 1, drift_error 0.2), the same runs at
    200 images 2 points worse a week stay within it in under 60% of them: each retry was a fresh 20%."""
    rules = GateRules(floors={})
    for n in RETRY_SIZES:
        for loss in (0.005, 0.02):
            share = within_budget(retrying_runs(n, loss, rules, 20), rules.drift_budget)
            assert share >= 0.90, (n, loss, share)
    weekly = GateRules(floors={}, drift_weeks=1, drift_error=0.2)
    assert within_budget(retrying_runs(200, 0.02, weekly, 20), weekly.drift_budget) < 0.60


def test_an_equal_challenger_is_still_blessed_where_the_drift_bound_can_decide():
    """The price of the promise, bounded: an equal challenger (6% disagreement) in the same retrying loop
    is blessed in at least 90% of the weeks at 5,000 test images, and in at least half at 1,000 (the
    drift bound needs about 2,400 images to pass an equal challenger 95% of the time;
    bench/gate_power.py publishes the rate at each size, 200 images included)."""
    rules = GateRules(floors={})
    for n, least in ((5_000, 0.90), (1_000, 0.50)):
        runs = retrying_runs(n, 0.0, rules, 10)
        rate = float(np.mean([b for run in runs for b in run.blessed]))
        assert rate >= least, (n, rate)


def test_a_look_past_the_drift_weeks_is_warned_refused_under_refuse_and_never_judged_laxer():
    """The drift's error is spent over `drift_weeks` looks per anchor: look 13 of a 12-look budget gets
    the DRIFT ERROR SPENT warning, is refused under `too_small: refuse`, and is judged at the same spent
    confidence as look 12 (more looks never buy a laxer bound). Looks 1 to 12 are as before."""
    n, k = 5_000, 10
    labels = np.arange(n) % k
    right = np.random.default_rng(3).random(n) < 0.9
    pred = np.where(right, labels, (labels + 1) % k)  # an equal challenger: the champion's answers
    classes = [f"c{i}" for i in range(k)]

    def at(look: int, too_small: str) -> dict:
        return judge(labels, pred, pred, classes, classes, GateRules(floors={}, too_small=too_small),
                     anchor_look=look)

    within, past = at(12, "bless"), at(13, "bless")
    assert within["blessed"] and not any("DRIFT ERROR SPENT" in w for w in within["warnings"])
    assert not within["drift"]["spent"] and past["drift"]["spent"] and past["drift"]["look"] == 13
    assert past["blessed"] and any(w.startswith("DRIFT ERROR SPENT: this is look 13") for w in past["warnings"])
    assert past["drift"]["confidence"] == within["drift"]["confidence"] == GateRules().drift_look_confidence
    assert past["drift"]["lower_bound"] == within["drift"]["lower_bound"]
    assert at(12, "refuse")["blessed"] and not at(13, "refuse")["blessed"]
