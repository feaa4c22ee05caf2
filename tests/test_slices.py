"""The gate's slices (last week's vs this week's test images, per supplier) and the week's relabels."""

import json

import numpy as np

from cnnpipe.release.render import render
from cnnpipe.release.slices import MAX_SUPPLIERS, slice_masks, week_relabels


def _store(tmp_path, new: list[bool] | None, suppliers: list[str | None]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"source": f"img/{i}.png", **({"supplier": s} if s is not None else {})}) + "\n"
             for i, s in enumerate(suppliers)]
    (tmp_path / "test_meta.jsonl").write_text("".join(lines))
    if new is not None:
        np.save(tmp_path / "test_new.npy", np.array(new))
    return tmp_path


def test_last_weeks_and_this_weeks_test_images_are_sliced_apart(tmp_path):
    slices = slice_masks(_store(tmp_path, [False, True, False, True, True], [None] * 5))
    assert list(slices) == ["last week's test images", "this week's new test images"]
    assert slices["this week's new test images"].tolist() == [False, True, False, True, True]
    assert (slices["last week's test images"] == ~slices["this week's new test images"]).all()


def test_a_first_store_or_one_that_predates_the_marks_has_no_week_slices(tmp_path):
    assert slice_masks(_store(tmp_path / "all", [True] * 3, [None] * 3)) == {}
    assert slice_masks(_store(tmp_path / "old", None, [None] * 3)) == {}


def test_each_supplier_is_a_slice_the_largest_first_and_at_most_twenty(tmp_path):
    names = ["acme"] * 5 + ["bolt"] * 3 + [None] * 2
    slices = slice_masks(_store(tmp_path / "two", None, names))
    assert list(slices) == ["supplier acme", "supplier bolt"]
    assert slices["supplier bolt"].tolist() == [False] * 5 + [True] * 3 + [False] * 2
    assert slice_masks(_store(tmp_path / "one", None, ["acme"] * 4)) == {}  # one supplier: the whole set again
    many = [f"s{i:02d}" for i in range(30) for _ in range(1 + i % 3)]
    assert len(slice_masks(_store(tmp_path / "many", None, many))) == MAX_SUPPLIERS


def test_a_week_that_relabels_more_than_the_share_of_a_class_says_so(tmp_path):
    index = {"classes": ["bag", "shoe", "hat"],
             "splits": {"train": {"class_counts": [80, 90, 50]}, "test": {"class_counts": [10, 10, 10]}}}
    report = tmp_path / "data_report.json"
    report.write_text(json.dumps({"relabels": [{"from": "shoe", "to": "bag", "images": 20},
                                               {"from": "hat", "to": "bag", "images": 1}]}))
    rows, warnings = week_relabels(report, index, max_share=0.05)
    assert [(r["from"], r["to"], r["images"]) for r in rows] == [("shoe", "bag", 20), ("hat", "bag", 1)]
    assert rows[0]["share_of_from"] == 20 / 120  # the class before the week: 100 today + 20 relabelled away
    assert len(warnings) == 1 and "20 images of 'shoe' (16.7% of the class)" in warnings[0]
    assert "release.max_relabel_share" in warnings[0]  # hat's 1 of 61 is within 5%
    assert week_relabels(tmp_path / "missing.json", index, 0.05) == ([], [])
    md = render({"blessed": True, "reasons": [], "warnings": warnings, "relabels": rows})
    assert "## Relabelled this week" in md and "| shoe | bag | 20 | 16.7% |" in md
