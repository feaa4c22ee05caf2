"""evaluate stage: test-set accuracy, per-class report, confusion, calibration, speed, memory."""

import argparse
import sys
from pathlib import Path

from cnnpipe.evaluate.evaluation import evaluate
from cnnpipe.params import ParamsError, load_params, resolve
from cnnpipe.train.budget import eval_batch, read_budget
from cnnpipe.train.checkpoint import UnsafeCheckpoint
from cnnpipe.train.distributed import resolve_device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--models", default="models")
    parser.add_argument("--metrics", default="metrics")
    parser.add_argument("--held-out", default="data/delivery/flagged.csv",
                        help="the delivery check's list: the photos it holds out (policy hold_out) are left out")
    parser.add_argument("--budget", type=Path, default=None,
                        help="the plan's budget.yaml: its eval_batch is the batch the test split runs at "
                        "(default: <metrics>/plan/budget.yaml when it exists)")
    args = parser.parse_args()
    try:
        cfg = resolve(load_params(args.params), args.variant)
        batch = eval_batch(read_budget(args.budget or Path(args.metrics) / "plan" / "budget.yaml"), args.variant)
    except (ParamsError, ValueError) as exc:  # (a ValueError from evaluating itself would be a bug: a traceback)
        print(f"evaluate[{args.variant}]: {exc}", file=sys.stderr)
        return 2
    try:
        result = evaluate(Path(args.models) / args.variant, Path(args.data), Path(args.metrics) / args.variant,
                          resolve_device(cfg.train.device), held_out=Path(args.held_out), batch_size=batch)
    except (ParamsError, UnsafeCheckpoint, FileNotFoundError) as exc:
        print(f"evaluate[{args.variant}]: {exc}", file=sys.stderr)
        return 2
    print(f"evaluate[{args.variant}]: top1={result['top1']:.4f} "
          f"(95% CI {result['top1_ci95_low']:.4f}-{result['top1_ci95_high']:.4f}) "
          f"top5={result['top5']:.4f} ece={result['ece']:.4f} on {result['images']} test images")
    for warning in result["warnings"]:
        print(f"evaluate[{args.variant}]: WARNING: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
