"""`dvc plots show`: each chart once, titled, its series the recipes, read from what DVC renders."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from dvc.render.converter.vega import get_datapoints

from cnnpipe.evaluate.plots import MIN_BIN_IMAGES, PERFECT, epoch_chart, reliability_chart
from conftest import ROOT
from test_pipeline import project, reproduced, run  # noqa: F401  (the reproduced tiny project)

RECIPES = {"baseline", "optimized"}
RELIABILITY = RECIPES | {"optimized before temperature", PERFECT}
EPOCH_CHARTS = {"Validation top-1 per epoch", "Training loss per epoch", "Training throughput per epoch (img/s)"}


def bins(counts: list[int]) -> list[dict]:
    """Calibration bins as `evaluate` writes them (CSV strings), accuracy = confidence + 0.05."""
    width = 1 / len(counts)
    return [{"bin_low": str(i * width), "bin_high": str((i + 1) * width), "count": str(n),
             "confidence": str((i + 0.5) * width), "accuracy": str((i + 0.5) * width + 0.05)}
            for i, n in enumerate(counts)]


def test_an_epoch_chart_has_a_field_per_recipe_and_null_past_a_shorter_run():
    histories = {"baseline": [{"epoch": e, "val_top1": e / 10} for e in (1, 2, 3)],
                 "optimized": [{"epoch": e, "val_top1": e / 5} for e in (1, 2)]}
    rows = epoch_chart(histories, "val_top1")
    assert rows == [{"epoch": 1, "baseline": 0.1, "optimized": 0.2}, {"epoch": 2, "baseline": 0.2, "optimized": 0.4},
                    {"epoch": 3, "baseline": 0.3, "optimized": None}]
    assert get_datapoints(rows) == rows  # DVC reads every row: the same fields in each


def test_the_reliability_chart_leaves_out_sparse_bins_and_draws_the_diagonal():
    curves = {"baseline": bins([0, MIN_BIN_IMAGES - 1, MIN_BIN_IMAGES, 900]), "optimized": bins([3, 60, 70, 800])}
    rows = reliability_chart(curves)
    assert get_datapoints(rows) == rows
    drawn = {name: [(r["confidence"], r[name]) for r in rows if r[name] is not None] for name in [*curves, PERFECT]}
    assert drawn["baseline"] == [(0.625, 0.675), (0.875, 0.925)]  # the empty bin and the one of 49 left out
    assert drawn["optimized"] == [(0.375, 0.425), (0.625, 0.675), (0.875, 0.925)]
    assert drawn[PERFECT] == [(0.0, 0.0), (1.0, 1.0)]
    assert all(sum(r[name] is not None for name in drawn) == 1 for r in rows)  # each row: one series
    assert [r["images"] for r in rows] == [MIN_BIN_IMAGES, 900, 60, 70, 800, None, None]


def test_the_reliability_title_states_the_bins_left_out():
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (title,) = [next(iter(p)) for p in plots if isinstance(p, dict) and "Reliability" in next(iter(p))]
    assert f"fewer than {MIN_BIN_IMAGES} images left out" in title


@pytest.mark.slow
def test_dvc_plots_show_draws_each_chart_once_with_the_recipes_as_its_series(project):  # noqa: F811
    """What DVC renders from the reproduced tiny project (`dvc plots show --json`): six charts, none
    twice; each titled; the per-epoch charts' series are `baseline` and `optimized`, coloured by
    recipe (not by file); the reliability diagram has the diagonal and only bins of enough images."""
    shown = json.loads(run(["dvc", "plots", "show", "--json"], project))
    assert "errors" not in shown, shown["errors"]
    charts = {plot_id: plots for plot_id, plots in shown["data"].items()}
    reliability = f"Reliability on the test split (bins of fewer than {MIN_BIN_IMAGES} images left out)"
    confusion = "Confusion matrix of the optimized model (test split)"
    assert set(charts) == EPOCH_CHARTS | {reliability, confusion, "metrics/optimized/mistakes.png"}
    assert all(len(plots) == 1 for plots in charts.values())  # one rendering each (one revision)
    for plot_id in EPOCH_CHARTS | {reliability, confusion}:
        (plot,) = charts[plot_id]
        spec = plot["content"]
        assert plot["type"] == "vega" and spec["title"]["text"] == plot_id
        values = spec["data"]["values"]
        if plot_id == confusion:
            assert {v["rev"] for v in values} == {"workspace"} and len(values) == 200  # a test image each
            continue
        assert spec["encoding"]["color"]["field"] == "field"  # the legend: the series' names, not files
        drawn = [v for v in values if v["dvc_inferred_y_value"] is not None]
        series = {v["field"] for v in drawn}
        if plot_id in EPOCH_CHARTS:
            assert series == RECIPES
            assert sorted(v["epoch"] for v in drawn) == [1, 1, 2, 2]  # two epochs of each recipe
            assert spec["encoding"]["x"]["title"] == "epoch"
        else:
            assert series <= RELIABILITY and PERFECT in series
            diagonal = [(v["confidence"], v["dvc_inferred_y_value"]) for v in drawn if v["field"] == PERFECT]
            assert diagonal == [(0.0, 0.0), (1.0, 1.0)]
            assert all(v["images"] >= MIN_BIN_IMAGES for v in drawn if v["field"] != PERFECT)
            assert {v["field"] for v in values} == RELIABILITY  # every curve is a series, drawn or not
            assert spec["encoding"]["color"]["scale"]["domain"] == sorted(RELIABILITY, key=[
                "baseline", "optimized", "optimized before temperature", PERFECT].index)
    (image,) = charts["metrics/optimized/mistakes.png"]
    assert image["type"] == "image"


@pytest.mark.slow
def test_the_page_loads_its_scripts_from_beside_it_with_the_offline_template(project):  # noqa: F811
    """README's recipe for a machine without internet: the page DVC writes with .dvc/plots/offline.html
    loads vega, vega-lite and vega-embed from dvc_plots/vendor/, nothing from a CDN."""
    run(["dvc", "plots", "show", "--html-template", ".dvc/plots/offline.html"], project)
    page = (project / "dvc_plots" / "index.html").read_text()
    assert re.findall(r'<script src="([^"]+)"', page) == [
        "vendor/vega.min.js", "vendor/vega-lite.min.js", "vendor/vega-embed.min.js"]
    assert "cdn" not in page and page.count("vegaEmbed(") == 5  # the five charts; the image is an <img>


@pytest.mark.slow
def test_the_gate_and_the_data_report_headlines_are_in_dvc_metrics_show(project):  # noqa: F811
    """The README's command for them: `dvc metrics show metrics/gate.json metrics/data_report.json`."""
    shown = json.loads(run(["dvc", "metrics", "show", "--json", "metrics/gate.json", "metrics/data_report.json"],
                           project))
    (workspace,) = shown.values()
    data = workspace["data"]
    gate, report = data["metrics/gate.json"]["data"], data["metrics/data_report.json"]["data"]
    assert isinstance(gate["blessed"], bool) and "first_model" in gate
    assert set(report["splits"]) == {"train", "val", "test"} and report["num_bad"] == 0
