"""The gate's statistics and rules, the warm start's class mapping and the temperature, at their edges."""

import math

import numpy as np
import pytest
import timm
import torch

from cnnpipe.evaluate.metrics import calibration_bins, expected_calibration_error
from cnnpipe.models import warm_start
from cnnpipe.release.gate import (
    GateRules,
    Paired,
    class_changes,
    decide,
    difference_lower_bound,
    mcnemar_p,
    paired_counts,
    wilson,
)
from cnnpipe.train.temperature import fit_temperature


def test_the_non_inferiority_bound_matches_a_hand_worked_case():
    """1,000 test images: both right 800, champion only 30, challenger only 50, both wrong 120.
    Champion 83.0%, challenger 85.0%, difference +2.0 points; z(0.95) = 1.644854.
    Wilson 95%-one-sided intervals: champion's upper 0.848642, challenger's lower 0.830484.
    phi = (800*120 - 30*50) / sqrt(830*170*850*150) = 94500 / 134128.7 = 0.704552.
    Newcombe (method 10): L = 0.02 - sqrt(0.019516^2 - 2*0.704552*0.019516*0.018642 + 0.018642^2)
                            = 0.02 - sqrt(0.00038088 - 0.00051265 + 0.00034753) = 0.02 - 0.014688 = +0.00531.
    (The Wald bound, 0.02 - 1.644854 * sqrt(80 - 400/1000) / 1000 = +0.00532, nearly agrees here.)"""
    table = Paired(both_right=800, negative_flips=30, positive_flips=50, both_wrong=120)
    z = 1.6448536
    assert wilson(830, 1000, z)[1] == pytest.approx(0.848642, abs=1e-6)
    assert wilson(850, 1000, z)[0] == pytest.approx(0.830484, abs=1e-6)
    assert difference_lower_bound(table) == pytest.approx(0.00531, abs=1e-5)
    # 30 against 50 discordant pairs: two-sided exact binomial, 2 * P(X <= 30 | 80, 1/2)
    assert mcnemar_p(table) == pytest.approx(2 * sum(math.comb(80, k) for k in range(31)) / 2**80)


def test_mcnemar_and_the_bound_at_their_edges():
    assert mcnemar_p(Paired(10, 0, 6, 4)) == pytest.approx(2 * 0.5**6)  # all six flips one way
    assert mcnemar_p(Paired(10, 0, 0, 4)) == 1.0  # nothing changed
    same = Paired(900, 0, 0, 100)  # identical answers: the bound is 0 minus the interval's width, never below -1
    assert -0.05 < difference_lower_bound(same) < 0.0
    assert difference_lower_bound(Paired(0, 100, 0, 0)) >= -1.0
    assert paired_counts(np.array([1, 1, 0, 0], bool), np.array([1, 0, 1, 0], bool)) == Paired(1, 1, 1, 1)


def _changes(champion_right: int, challenger_right: int, support: int = 20):
    labels = np.zeros(support, dtype=np.int64)
    champion = np.where(np.arange(support) < champion_right, 0, 1)
    challenger = np.where(np.arange(support) < challenger_right, 0, 1)
    return labels, champion, challenger


def test_the_per_class_rule_at_its_boundary():
    rules = GateRules(margin=0.99, min_support=20, max_class_drop=0.05, floors={})  # judge classes alone
    metrics = {"top1": 0.9}
    for challenger_right, blessed in ((19, True), (18, False)):  # 100% -> 95%: a drop of exactly 5 points passes
        labels, champion, challenger = _changes(20, challenger_right)
        changes = class_changes(labels, champion, challenger, ["shirt", "bag"], ["shirt", "bag"])
        verdict = decide(rules, metrics, paired_counts(champion == labels, challenger == labels), changes, [])
        assert verdict["blessed"] is blessed
        assert (verdict["classes_failing"] == ["shirt"]) is (not blessed)
    labels, champion, challenger = _changes(19, 10, support=19)  # under min_support: listed, not judged
    changes = class_changes(labels, champion, challenger, ["shirt", "bag"], ["shirt", "bag"])
    assert decide(rules, metrics, paired_counts(champion == labels, challenger == labels), changes, [])["blessed"]


def test_classes_are_matched_by_name_and_a_new_one_counts_as_the_champions_error():
    labels = np.array([0, 0, 1, 1, 2, 2])  # today: coat, bag, hat (hat is new)
    champion = np.array([0, 0, 1, 1, 0, 1])  # it never says hat
    challenger = np.array([0, 0, 1, 1, 2, 2])
    changes = class_changes(labels, champion, challenger, ["coat", "bag", "hat"], ["bag", "coat"])
    by_name = {c.name: c for c in changes}
    assert by_name["hat"].champion_recall is None and by_name["hat"].challenger_recall == 1.0
    assert by_name["coat"].champion_recall == 1.0 and by_name["bag"].drop == 0.0


def test_floors_and_the_first_model():
    rules = GateRules(floors={"top1": 0.8, "macro_f1": 0.7})
    first = decide(rules, {"top1": 0.85, "macro_f1": 0.75}, None, [], [])
    assert first["blessed"] and first["first_model"] and "first model" in first["reasons"][0]
    low = decide(rules, {"top1": 0.85, "macro_f1": 0.6}, None, [], [])
    assert not low["blessed"] and any("macro_f1 0.6000 is below the floor" in r for r in low["reasons"])
    with pytest.raises(KeyError, match="release.floors names 'top9'"):
        decide(GateRules(floors={"top9": 0.5}), {"top1": 0.85}, None, [], [])


def test_a_worse_challenger_is_refused_with_its_reason():
    verdict = decide(GateRules(floors={}), {"top1": 0.80}, Paired(780, 60, 20, 140), [], [])
    assert not verdict["blessed"]
    assert verdict["paired"]["negative_flips"] == 60 and verdict["paired"]["lower_bound"] < -0.01
    assert any("below the allowed -1.00%" in r for r in verdict["reasons"])


def test_the_warm_start_maps_the_classifier_by_class_name():
    torch.manual_seed(0)
    old = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    new = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    fresh = new.state_dict()["fc.weight"].clone()
    report = warm_start(new, old.state_dict(), ["coat", "bag", "shoe"], ["shoe", "coat", "hat"])
    assert report == {"kept": ["shoe", "coat"], "new": ["hat"], "removed": ["bag"]}
    weights, old_weights = new.state_dict()["fc.weight"], old.state_dict()["fc.weight"]
    assert torch.equal(weights[0], old_weights[2]) and torch.equal(weights[1], old_weights[0])  # reordered
    assert torch.equal(weights[2], fresh[2])  # the new class keeps its fresh row
    assert torch.equal(new.state_dict()["fc.bias"][0], old.state_dict()["fc.bias"][2])
    body = [k for k in old.state_dict() if not k.startswith("fc.")]
    assert all(torch.equal(new.state_dict()[k], old.state_dict()[k]) for k in body)
    with pytest.raises(ValueError, match="do not fit this model"):
        warm_start(timm.create_model("test_resnet", num_classes=3, in_chans=3), old.state_dict(), ["a"] * 3, ["a"] * 3)


def test_a_fitted_temperature_calibrates_an_under_confident_model():
    """Labels drawn from softmax(z): z is calibrated. The model reports z / 4 (under-confident, like
    label smoothing makes it); the fitted temperature is about 1/4 and brings the ECE down."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, 10, generator=gen) * 3
    labels = torch.multinomial(torch.softmax(z, 1), 1, generator=gen).squeeze(1)
    shown = z / 4
    t = fit_temperature(shown, labels)
    assert t == pytest.approx(0.25, rel=0.1)
    before = expected_calibration_error(calibration_bins(torch.softmax(shown, 1), labels))
    after = expected_calibration_error(calibration_bins(torch.softmax(shown / t, 1), labels))
    assert before > 0.15 and after < 0.02
    assert torch.equal((shown / t).argmax(1), shown.argmax(1))  # no prediction moves


def test_promote_refuses_an_unblessed_verdict_or_one_judged_against_another_champion(monkeypatch, tmp_path):
    from cnnpipe.config import ReleaseConfig
    from cnnpipe.release import promote

    refused = {"blessed": False, "reasons": ["class 'red' loses 90.0% of recall"], "champion": None}
    with pytest.raises(promote.Refused, match="did not bless this model:\n  - class 'red' loses"):
        promote.promote(tmp_path, ReleaseConfig(), refused)
    monkeypatch.setattr(promote, "in_stage", lambda repo, name, stage: {"version": "v0.2.0", "commit": "b" * 40})
    with pytest.raises(promote.Refused, match="judged against v0.1.0, but 'prod' now holds v0.2.0"):
        promote.check_same_champion(tmp_path, ReleaseConfig(), {"champion": {"version": "v0.1.0", "commit": "a" * 40}})
    with pytest.raises(promote.Refused, match="judged against no champion"):  # a gate run without the tags
        promote.check_same_champion(tmp_path, ReleaseConfig(), {"champion": {"version": None}})
    promote.check_same_champion(tmp_path, ReleaseConfig(), {"champion": {"version": "v0.2.0", "commit": "b" * 40}})
