"""compare stage: metrics/compare.json and metrics/compare.md (baseline vs optimized), and the data of
the charts `dvc plots show` draws side by side (metrics/plots/)."""

import argparse
import json
import sys
from pathlib import Path

from cnnpipe.evaluate.compare import compare, load_variant, plan_vs_actual, roofline_of, to_markdown
from cnnpipe.evaluate.plots import write_plot_data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", default="metrics")
    parser.add_argument("--plots", help="where the charts' data goes (default: <metrics>/plots)")
    args = parser.parse_args()
    metrics = Path(args.metrics)
    try:
        base, opt = load_variant(metrics, "baseline"), load_variant(metrics, "optimized")
        result = compare(base, opt)
    except (FileNotFoundError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    roofs = {v: roofline_of(json.loads((metrics / "profile" / f"{v}.json").read_text()))
             for v in ("baseline", "optimized") if (metrics / "profile" / f"{v}.json").exists()}
    if roofs:
        result["roofline"] = roofs
    plan_path = metrics / "plan" / "plan.json"
    if plan_path.exists():
        result["plan"] = plan_vs_actual(json.loads(plan_path.read_text()), base, opt)
    (metrics / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = to_markdown(result)
    (metrics / "compare.md").write_text(markdown)
    print(markdown)
    try:  # after the comparison, which stands without them
        write_plot_data({"baseline": base["train"]["history"], "optimized": opt["train"]["history"]}, metrics,
                        Path(args.plots) if args.plots else metrics / "plots")
    except (FileNotFoundError, ValueError) as exc:
        print(f"compare: the charts' data: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
