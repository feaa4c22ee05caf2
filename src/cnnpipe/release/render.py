"""gate.md: the verdict of gate.json in words and tables, the same numbers (never others)."""

from __future__ import annotations

from typing import Any


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def headline(verdict: dict[str, Any]) -> str:
    """BLESSED, BLESSED WITH A WARNING (too small to judge) or REFUSED."""
    if not verdict["blessed"]:
        return "REFUSED"
    return "BLESSED WITH A WARNING: too small to judge" if verdict.get("too_small") else "BLESSED"


def _paired_row(name: str, p: dict[str, Any]) -> str:
    needed = "" if p.get("images_needed") is None else f"{p['images_needed']:,}"
    return (f"| {_cell(name)} | {p['images']:,} | {p['champion_top1']:.2%} | {p['challenger_top1']:.2%} | "
            f"{p['difference']:+.2%} | {p['lower_bound']:+.2%} | {p['upper_bound']:+.2%} | "
            f"{p['negative_flips']} / {p['positive_flips']} | {needed} | {p['outcome']} |")


def _p(p: float) -> str:
    return "< 1e-300" if p < 1e-300 else f"{p:.2g}"  # an exact test's p-value can underflow to 0


def _delivery_lines(delivery: dict[str, Any] | None) -> list[str]:
    """The delivery check's flags (metrics/delivery.json), repeated: what this week's photos looked like."""
    if not delivery:
        return []
    if not delivery.get("flagged"):
        said = "nothing flagged" if delivery.get("checked") else f"not checked: {delivery.get('reason')}"
        return ["", f"Delivery check: {said} ({delivery.get('new_images', 0):,} new photos).", *_open_lines(delivery)[1:]]
    lines = ["", f"## Delivery check: {delivery['flagged_images']:,} of {delivery['new_images']:,} new photos flagged "
             f"(policy `{delivery['policy']}`; every one in `{delivery.get('list')}`)", "",
             "| Filed as | Looks like | Photos | Share | Expected | p (Holm) |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {_cell(r['given'])} | {_cell(r['predicted'])} | {r['images']} of {r['of']} | {r['share']:.0%} | "
              f"{r['expected']:.1%} | {_p(r['p_holm'])} |" for r in delivery["pairs"]]
    return lines + _open_lines(delivery)


def _open_lines(delivery: dict[str, Any]) -> list[str]:
    """Photos held since earlier weeks and what promote will ask while any flag is open."""
    held, cleared, open_ = (delivery.get(k) or 0 for k in ("held_from_earlier_weeks", "cleared", "open_flags"))
    lines = [f"{held:,} photo(s) flagged in an earlier week are still held out."] if held else []
    lines += [f"{cleared:,} flagged photo(s) cleared in `data/delivery/cleared.csv`."] if cleared else []
    if open_:
        lines.append(f"{open_:,} flagged photo(s) open: `python -m cnnpipe.promote` asks for `--accept-flagged`.")
    return ["", *lines] if lines else []


def render(verdict: dict[str, Any]) -> str:
    """gate.md: the verdict first, then the warnings and every reason, then the tables behind them."""
    champion = verdict.get("champion") or {}
    who = (f"{champion.get('artifact', 'the model')} {champion['version']} (in `{champion.get('stage', 'prod')}`)"
           if champion.get("version") else "no champion yet")
    lines = [f"# Gate: {headline(verdict)}", "", f"Challenger: this commit's optimized model. Champion: {who}.", ""]
    lines += [f"- **{w}**" for w in verdict.get("warnings", [])]
    lines += [f"- {reason}" for reason in verdict["reasons"]]
    paired = verdict.get("paired")
    if paired:
        lines += ["", "## Like for like: the test images of the classes the champion knows", "",
                  f"Bounds one-sided at {paired['confidence']:.0%}; flips: now wrong / now right; *needed*: the test "
                  "images the margin needs at this discordance.", "",
                  "| Images | Test images | Champion top-1 | Challenger top-1 | Change | At worst | At best | Flips "
                  "| Needed | Outcome |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
                  _paired_row("all", paired)]
        if verdict.get("served"):
            lines.append(_paired_row("all, as served (a new class's answer is wrong)", verdict["served"]))
        lines += [_paired_row(name, p) for name, p in (verdict.get("slices") or {}).items()]
    drift = verdict.get("drift")
    if drift:
        lines += ["", f"## Drift from the anchor ({_cell(drift['anchor'])})", "",
                  "| Test images | Anchor top-1 | Challenger top-1 | Change | At worst | Budget | Within "
                  "| New anchor |",
                  "|---:|---:|---:|---:|---:|---:|---|---|",
                  f"| {drift['images']:,} | {drift['anchor_top1']:.2%} | {drift['challenger_top1']:.2%} | "
                  f"{drift['difference']:+.2%} | {drift['lower_bound']:+.2%} ({drift['confidence']:.2%}) | "
                  f"-{drift['budget']:.2%} | {'yes' if drift['within'] else 'NO'} | "
                  f"{'yes' if drift.get('new_anchor') else 'no'} |"]
    if verdict.get("worst_classes"):
        lines += ["", f"## Classes as served ({verdict['classes_judged']} judged; the worst first)", "",
                  "| Class | Test images | Champion recall | Challenger recall | Among the champion's classes | Change "
                  "| Flips | p | Tested at | |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in verdict["worst_classes"]:
            mark = "FAILS" if c["failing"] else ("" if c["judged"] else "too few to judge")
            lines.append(f"| {_cell(c['class'])} | {c['support']} | {c['champion_recall']:.1%} | "
                         f"{c['challenger_recall']:.1%} | "
                         f"{c.get('challenger_recall_like_for_like', float('nan')):.1%} | "
                         f"{-c['drop']:+.1%} | {c['negative_flips']} / "
                         f"{c['positive_flips']} | {c['p_worse']:.2g} | {c['level']:.2g} | {mark} |")
    if verdict.get("new_classes"):
        lines += ["", "## New classes, judged on their own", "",
                  "| Class | Test images | Recall | Bounds | p below the floor (Holm) | |", "|---|---:|---:|---|---:|---|"]
        for c in verdict["new_classes"]:
            lo, hi = c["bounds"]
            lines.append(f"| {_cell(c['class'])} | {c['support']} | {c['recall']:.1%} | {lo:.1%} to {hi:.1%} | "
                         f"{c['p_holm']:.2g} | {'FAILS' if c['failing'] else ''} |")
    if verdict.get("to_new_classes"):
        lines += ["", "## Old classes' test images now called a new class", "",
                  "| From | To | Images | Share | |", "|---|---|---:|---:|---|"]
        for r in verdict["to_new_classes"]:
            to = ", ".join(f"{name} {count}" for name, count in r["to"].items())
            lines.append(f"| {_cell(r['from'])} | {_cell(to)} | {r['images']} of {r['of']} | {r['share']:.1%} | "
                         f"{'FAILS' if r['failing'] else ''} |")
    overall, pooled = verdict.get("to_new_overall"), verdict.get("to_new_pooled")
    if overall:
        lines += ["", f"All the old classes' test images: {overall['images']} of {overall['of']} "
                      f"({overall['share']:.1%}) now called a new class{' (FAILS)' if overall['failing'] else ''}"]
        if pooled and pooled["of"]:
            lines[-1] += (f"; the {pooled['classes']} classes too small to judge alone, pooled: {pooled['images']} of "
                          f"{pooled['of']} ({pooled['share']:.1%}){' (FAILS)' if pooled['failing'] else ''}")
        lines[-1] += "."
    if verdict.get("relabels"):
        lines += ["", "## Relabelled this week (bytes the split ledger knew under another label)", "",
                  "| From | To | Images | Share of the former class |", "|---|---|---:|---:|"]
        lines += [f"| {_cell(r['from'])} | {_cell(r['to'])} | {r['images']} | {r['share_of_from']:.1%} |"
                  for r in verdict["relabels"]]
    lines += _delivery_lines(verdict.get("delivery"))
    lines += ["", "Promote a blessed model with `python -m cnnpipe.promote` (it refuses a refused one).", ""]
    return "\n".join(lines)
