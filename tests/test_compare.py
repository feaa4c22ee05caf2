"""How sure the comparison is: intervals, McNemar's test and the speed spread, on constructed results."""

import json
import math
from pathlib import Path

import pytest

from cnnpipe.evaluate.compare import (
    compare,
    limit_sentence,
    load_variant,
    paired_significance,
    roofline_of,
    speed_spread,
    to_markdown,
)
from cnnpipe.evaluate.evaluation import split_warnings
from cnnpipe.evaluate.stats import mcnemar_exact, median_iqr, ratio_range, wilson_interval
from cnnpipe.profile.roofline import limit
from conftest import ROOT, Stage


def test_wilson_interval_matches_the_textbook_values():
    # 81/263: Wilson 95% interval 0.2553-0.3662 (Newcombe 1998, table I, example b is 81/263).
    low, high = wilson_interval(81, 263)
    assert low == pytest.approx(0.2553, abs=1e-4) and high == pytest.approx(0.3662, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    narrow, wide = wilson_interval(5000, 10000), wilson_interval(12, 24)
    assert narrow[1] - narrow[0] < 0.02 < 0.3 < wide[1] - wide[0]


def test_mcnemar_stays_exact_and_fast_at_a_million_test_images():
    """A catalog's test split: the integer binomial sum took hours at this size (the suite's timeout
    would end it); the same exact tail comes from scipy at once."""
    import math

    exact = 2 * sum(math.comb(2000, i) for i in range(961)) / 2**2000
    assert mcnemar_exact(960, 1040) == pytest.approx(exact, rel=1e-9)
    assert 0.0 < mcnemar_exact(499_000, 501_000) < 0.1


def test_mcnemar_exact_p_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    # 1 vs 9 discordant: 2 * P(X <= 1 | n=10, 1/2) = 2 * 11/1024
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(300, 2300) < 1e-300 or mcnemar_exact(300, 2300) == 0.0  # large n stays exact, no overflow


def _predictions(actual: list[str], right: list[bool]) -> dict[str, list[str]]:
    return {"actual": actual, "predicted": [a if ok else f"not {a}" for a, ok in zip(actual, right)]}


def test_an_identical_pair_is_no_difference():
    actual = [f"c{i % 10}" for i in range(1000)]
    preds = _predictions(actual, [i % 3 != 0 for i in range(1000)])
    sig = paired_significance(preds, preds)
    assert sig["p_value"] == 1.0 and sig["verdict"] == "no significant difference"
    assert sig["only_baseline_right"] == sig["only_optimized_right"] == 0


def test_a_clear_win_is_called_better_and_a_clear_loss_worse():
    actual = [f"c{i % 10}" for i in range(1000)]
    base = _predictions(actual, [i % 2 == 0 for i in range(1000)])  # 50%
    opt = _predictions(actual, [i % 10 != 9 for i in range(1000)])  # 90%
    sig = paired_significance(base, opt)
    assert sig["verdict"] == "optimized is better" and sig["p_value"] < 1e-6
    assert sig["only_optimized_right"] == 400 and sig["only_baseline_right"] == 0
    assert paired_significance(opt, base)["verdict"] == "baseline is better"


def test_different_test_labels_are_refused():
    with pytest.raises(ValueError, match="different test labels"):
        paired_significance({"actual": ["a", "b"], "predicted": ["a", "b"]},
                            {"actual": ["b", "a"], "predicted": ["a", "b"]})


def test_the_speed_ratio_comes_with_a_range_and_an_overlap_note():
    assert median_iqr([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    fast, slow = [110.0, 112.0, 115.0, 113.0], [84.0, 86.0, 87.0, 81.0]
    r = ratio_range(fast, slow)
    assert r["low"] < r["ratio"] < r["high"] and not r["overlap"]
    assert r["ratio"] == pytest.approx(112.5 / 85.0)  # the medians, worked out by hand
    noisy = ratio_range([90.0, 120.0, 100.0, 95.0], [85.0, 110.0, 92.0, 99.0])
    assert noisy["overlap"] and noisy["low"] < 1.0 < noisy["high"]
    spread = speed_spread({"history": [{"throughput_img_s": v} for v in slow]},
                          {"history": [{"throughput_img_s": v} for v in fast]})
    assert spread["optimized"]["epochs"] == 4 and spread["ratio"] == pytest.approx(r["ratio"])


def test_small_or_carved_test_splits_are_flagged():
    assert split_warnings(10000, ["val"]) == []
    small = split_warnings(24, ["val", "test"])
    assert len(small) == 2 and "24 images" in small[0] and "carved" in small[1]


def _write_variant(root: Path, name: str, top1_right: list[bool], throughputs: list[float],
                   warnings: list[str], init: str = "random") -> None:
    actual = [f"c{i % 2}" for i in range(len(top1_right))]
    preds = _predictions(actual, top1_right)
    n, k = len(actual), sum(top1_right)
    low, high = wilson_interval(k, n)
    out = root / name
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps({
        "top1": k / n, "top1_ci95_low": low, "top1_ci95_high": high, "top5": 1.0, "top5_ci95_low": 0.9,
        "top5_ci95_high": 1.0, "ece": 0.1, "model_throughput_img_s": 500.0, "warnings": warnings}))
    (out / "train.json").write_text(json.dumps({
        "epoch_time_s": 100 / statistics_median(throughputs), "train_time_s": 10.0,
        "throughput_img_s": statistics_median(throughputs), "data_wait_frac": 0.1, "peak_mem_mb": 100.0,
        "init": init, "history": [{"epoch": e + 1, "throughput_img_s": t, "train_loss": 1.0, "val_top1": 0.5}
                    for e, t in enumerate(throughputs)]}))
    bins = "bin_low,bin_high,count,confidence,accuracy\n0.0,0.5,4,0.4,0.5\n0.5,1.0,20,0.8,0.7\n"
    (out / "calibration.csv").write_text(bins)
    (out / "calibration_raw.csv").write_text(bins)
    rows = "".join(f"{a},{p}\n" for a, p in zip(preds["actual"], preds["predicted"]))
    (out / "predictions.csv").write_text("actual,predicted\n" + rows)


def statistics_median(values: list[float]) -> float:
    return median_iqr(values)[1]


def test_a_tiny_test_set_gets_a_warning_and_no_better_claim(tmp_path, stage: Stage):
    """24 test images, 14 vs 17 right: a 12.5-point gap that McNemar cannot back."""
    warning = split_warnings(24, ["val", "test"])
    _write_variant(tmp_path, "baseline", [i < 14 for i in range(24)], [80.0, 82.0], warning)
    _write_variant(tmp_path, "optimized", [i < 17 for i in range(24)], [81.0, 83.0], warning)
    ran = stage(tmp_path, "compare.py", "--metrics", str(tmp_path))
    assert ran.code == 0, ran.err[-3000:]
    md = (tmp_path / "compare.md").read_text()
    assert "**no significant difference**" in md and "better" not in md
    assert "small test split: 24 images" in md and "carved out of the training images" in md
    assert "within run-to-run spread" in md
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["significance"]["p_value"] == pytest.approx(mcnemar_exact(0, 3))


def test_the_comparison_stands_when_the_charts_data_cannot_be_written(tmp_path, stage: Stage):
    """compare.json and compare.md come first; a missing calibration file then fails the stage naming it."""
    for name, right in (("baseline", 14), ("optimized", 17)):
        _write_variant(tmp_path, name, [i < right for i in range(24)], [80.0, 82.0], [])
    proc = stage(tmp_path, "compare.py", "--metrics", str(tmp_path))
    assert proc.code == 0 and json.loads((tmp_path / "plots" / "val_top1.json").read_text())[1] == {
        "epoch": 2, "baseline": 0.5, "optimized": 0.5}
    (tmp_path / "optimized" / "calibration_raw.csv").unlink()
    (tmp_path / "compare.json").unlink()
    proc = stage(tmp_path, "compare.py", "--metrics", str(tmp_path))
    assert proc.code == 2 and "optimized/calibration_raw.csv not found" in proc.err
    assert (tmp_path / "compare.json").exists()


@pytest.mark.parametrize("optimized_init", ["random", "torch-hub-cache:/root/.cache/torch/hub/checkpoints/r50.pth"])
def test_the_headline_says_when_the_weights_not_the_recipe_may_be_the_gain(tmp_path, optimized_init, stage: Stage):
    """The shipped baseline is pinned to random init; the optimized recipe starts from weights when it
    finds them. compare.md's headline then says the gap is not all the recipe's, and how to train the
    baseline from the same weights; from the same start it says nothing of the kind."""
    _write_variant(tmp_path, "baseline", [i < 100 for i in range(400)], [80.0, 82.0], [])
    _write_variant(tmp_path, "optimized", [i < 300 for i in range(400)], [81.0, 83.0], [], init=optimized_init)
    ran = stage(tmp_path, "compare.py", "--metrics", str(tmp_path))
    assert ran.code == 0, ran.err[-3000:]
    headline = (tmp_path / "compare.md").read_text().split("| Metric |")[0]
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["starts"]["baseline"] == "random init"
    if optimized_init == "random":
        assert "start" not in headline.lower()
    else:
        assert "**the recipes start differently**, the baseline from random init, the optimized from pretrained " \
               "weights (/root/.cache/torch/hub/checkpoints/r50.pth)" in headline
        assert "`dvc exp run -S variants.baseline.model.pretrained=true`" in headline


def _exact_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value, written out here independently of cnnpipe.evaluate.stats."""
    n, k = b + c, min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def test_inference_speeds_timed_at_different_batches_get_no_ratio(tmp_path):
    """A small box times each recipe's inference at its own batch (budget.yaml `eval_batch`); at 128 px on
    a CPU batch 16 runs 1.3x batch 32 per image, so a ratio of the two would be the batches', not the recipes'."""
    for name, right, batch in (("baseline", 14, 16), ("optimized", 17, 32)):
        _write_variant(tmp_path, name, [i < right for i in range(24)], [80.0, 82.0], [])
        path = tmp_path / name / "eval.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "eval_batch": batch}))
    result = compare(load_variant(tmp_path, "baseline"), load_variant(tmp_path, "optimized"))
    assert result["rows"]["eval_throughput_img_s"]["ratio"] is None
    assert "| Inference (img/s, model only) | 500 | 500 | n/a (batch 16 vs 32) |" in to_markdown(result)
    path = tmp_path / "optimized" / "eval.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eval_batch": 16}))
    same = compare(load_variant(tmp_path, "baseline"), load_variant(tmp_path, "optimized"))
    assert same["rows"]["eval_throughput_img_s"]["ratio"] == 1.0


def test_the_committed_comparison_agrees_with_the_committed_accuracies():
    """metrics/compare.json and compare.md, as committed, against the two eval.json files: the paired
    counts add up to the test images and to each model's top-1, and the test and the headline follow
    from them. (predictions.csv, one row per test image, is DVC-tracked: not in a fresh clone.)"""
    metrics = ROOT / "metrics"
    committed = json.loads((metrics / "compare.json").read_text())
    significance = committed["significance"]
    n = significance["test_images"]
    counts = {k: significance[k] for k in ("both_right", "only_baseline_right", "only_optimized_right", "both_wrong")}
    assert sum(counts.values()) == n
    right = {"baseline": counts["both_right"] + counts["only_baseline_right"],
             "optimized": counts["both_right"] + counts["only_optimized_right"]}
    for variant, k in right.items():
        result = json.loads((metrics / variant / "eval.json").read_text())
        assert result["images"] == n and result["top1"] == pytest.approx(k / n)
    p_value = _exact_mcnemar(counts["only_baseline_right"], counts["only_optimized_right"])
    assert significance["p_value"] == pytest.approx(p_value, rel=1e-6, abs=1e-300)
    better = "optimized" if counts["only_optimized_right"] > counts["only_baseline_right"] else "baseline"
    verdict = f"{better} is better" if p_value < significance["alpha"] else "no significant difference"
    assert significance["verdict"] == verdict
    md = (metrics / "compare.md").read_text()
    assert f"**{verdict}**" in md and "Train throughput per epoch" in md
    for variant, k in right.items():
        assert f"{100 * k / n:.2f}%" in md, variant


def test_every_stage_is_set_beside_its_prediction_with_the_training_share():
    from cnnpipe.evaluate.compare import plan_vs_actual

    plan = {"budget_minutes": 20, "images_per_epoch": 3328, "fraction": 1 / 16, "predicted_total_s": 1000.0,
            "spent_s": {"prepare": 20.0}, "profile_s": {"profile@baseline": 50.0, "profile@optimized": 100.0},
            "predicted_s": {"train@baseline": 300.0, "train@optimized": 250.0, "evaluate@baseline": 40.0,
                            "evaluate@optimized": 30.0, "export@baseline": 60.0, "export@optimized": 50.0}}

    def variant(train, evaluate, export):
        return {"train": {"stage_time_s": train}, "eval": {"stage_time_s": evaluate},
                "export": {"stage_time_s": export}}

    result = plan_vs_actual(plan, variant(330.0, 36.0, 66.0), variant(225.0, 30.0, None))
    rows = result["stages"]
    assert rows["train@baseline"]["ratio"] == pytest.approx(1.1) and rows["export@optimized"]["ratio"] is None
    assert rows["profile@optimized"] == {"predicted_s": None, "actual_s": 100.0, "ratio": None}
    assert rows["prepare"] == {"predicted_s": None, "actual_s": 20.0, "ratio": None}  # measured before the plan
    assert result["measured_total_s"] == pytest.approx(20 + 50 + 100 + 330 + 36 + 66 + 225 + 30)
    assert result["training_share"] == pytest.approx((330 + 225) / result["measured_total_s"])
    # the same rows' prediction (measured ones as measured; export@optimized has no actual), beside the whole run's
    assert result["predicted_rows_s"] == pytest.approx(20 + 50 + 100 + 300 + 250 + 40 + 30 + 60 + 50)
    assert result["predicted_total_s"] == 1000.0


def test_the_speed_claim_says_what_share_of_the_machines_limit_each_recipe_reached():
    """Beside the ratio, each recipe's step against the bf16 matmul rate its profile measured (and, for
    a recipe that trains in fp32, against that rate too); none without both profiles' rooflines. Where
    the profile measured fp32 faster than bf16 (a CPU without AMX), the limit is the fp32 rate."""
    def profile(math: str, share: float, gflops: float, fp32: float | None = 200.0) -> dict:
        peaks = {"bf16_gflops": 400.0, "fp32_gflops": fp32}
        faster, rate = limit(peaks)  # (as the profile's roofline records it)
        return {"roofline": {"math": math, "math_share": gflops / (fp32 if math == "fp32" else 400.0),
                             "bf16_share": share, "achieved_gflops": gflops, "limit": faster,
                             "limit_share": gflops / rate, "peaks": peaks}}

    roof = {"baseline": roofline_of(profile("fp32", 0.23, 92.0)),
            "optimized": roofline_of(profile("bf16", 0.43, 172.0))}
    said = limit_sentence({"roofline": roof})
    assert "baseline 23% (92 GFLOP/s, 46% of its fp32 rate)" in said and "optimized 43% (172 GFLOP/s)" in said
    assert "of the bf16 matmul rate the profile measured (400 GFLOP/s)" in said
    assert limit_sentence({"roofline": {"baseline": roof["baseline"]}}) is None and roofline_of({}) is None
    slow_bf16 = {"baseline": roofline_of(profile("fp32", 0.23, 92.0, fp32=500.0)),
                 "optimized": roofline_of(profile("bf16", 0.43, 172.0, fp32=500.0))}
    said = limit_sentence({"roofline": slow_bf16})
    assert "baseline 18% (92 GFLOP/s)" in said and "optimized 34% (172 GFLOP/s, 43% of its bf16 rate)" in said
    assert "of the fp32 matmul rate the profile measured, this CPU's faster one (500 GFLOP/s; bf16 400)" in said
    # the two profiles disagree on which rate is faster: each against the bf16 rate, as it measured it
    mixed = {"baseline": roof["baseline"], "optimized": slow_bf16["optimized"]}
    said = limit_sentence({"roofline": mixed})
    assert "optimized 43% (172 GFLOP/s)" in said and "of the bf16 matmul rate the profile measured (400" in said
    no_fp32 = roofline_of(profile("bf16", 0.43, 172.0, fp32=None))  # (a profile without the fp32 rate)
    assert no_fp32["limit"] == "bf16" and no_fp32["limit_share"] == pytest.approx(0.43)
    assert "of the bf16 matmul rate" in limit_sentence({"roofline": {**slow_bf16, "optimized": no_fp32}})


