"""Bottleneck rules at their edges."""

import pytest

from cnnpipe.diagnosis import (COMM_FRAC, INPUT_WAIT_FRAC, MEMORY_FRAC, SYNC_FRAC, Facts, diagnose)

COMPUTE = {"data_wait": 0.0, "copy": 0.0, "augment": 0.0, "forward": 0.3, "backward": 0.6, "optimizer": 0.1,
           "sync": 0.0}


def facts(**kw):
    fr = dict(COMPUTE)
    fr.update(kw.pop("fractions", {}))
    return Facts(fractions=fr, amp=kw.pop("amp", "bf16"), channels_last=kw.pop("channels_last", True), **kw)


@pytest.mark.parametrize("region, threshold, label", [
    ("data_wait", INPUT_WAIT_FRAC, "input"),
    ("communication", COMM_FRAC, "communication"),
    ("sync", SYNC_FRAC, "host_sync"),
])
def test_fraction_rules_fire_just_above_their_threshold(region, threshold, label):
    assert diagnose(facts(fractions={region: threshold}))[0] == "compute"
    fired, recs = diagnose(facts(fractions={region: threshold + 0.001}))
    assert fired == label
    assert recs[0].evidence[f"{region}_frac"] == pytest.approx(threshold + 0.001, abs=1e-4)


def test_input_advice_depends_on_the_loader():
    _, recs = diagnose(facts(fractions={"data_wait": 0.3}, loader="baseline"))
    assert "fast batched loader" in recs[0].action
    _, recs = diagnose(facts(fractions={"data_wait": 0.3}, loader="fast", num_workers=0))
    assert "num_workers" in recs[0].action
    assert "1.43x" in recs[0].expected_gain


def test_memory_rule():
    assert diagnose(facts(memory_frac=MEMORY_FRAC))[0] == "compute"
    label, recs = diagnose(facts(memory_frac=0.95, amp="off"))
    assert label == "memory" and "AMP" in recs[0].action


def test_small_batch_from_utilisation_or_measured_gain():
    assert diagnose(facts(utilization=0.5))[0] == "compute"
    assert diagnose(facts(utilization=0.49))[0] == "small_batch"
    assert diagnose(facts(batch_gain=1.15))[0] == "compute"
    label, recs = diagnose(facts(batch_gain=1.3, batch_size=8))
    assert label == "small_batch" and "1.30x" in recs[0].expected_gain


def test_compute_advice_amp_and_layout():
    label, recs = diagnose(facts(amp="off", channels_last=False))
    assert label == "compute"
    actions = " ".join(r.action for r in recs)
    assert "mixed precision" in actions and "channels_last" in actions
    assert diagnose(facts())[1] == []


def test_input_outranks_everything_else():
    label, recs = diagnose(facts(fractions={"data_wait": 0.4, "sync": 0.2}, memory_frac=0.99, utilization=0.1))
    assert label == "input" and [r.bottleneck for r in recs][:4] == ["input", "host_sync", "memory", "small_batch"]
