"""gate stage: is this commit's optimized model at least as good as the one in production?

Writes metrics/gate.json and metrics/gate.md. It exits 0 whether or not the challenger is blessed:
the verdict is a result; `python -m cnnpipe.promote` is what refuses a model that is not.
"""

import argparse
import sys
from pathlib import Path

from cnnpipe.params import ParamsError, load_params, release_config, resolve
from cnnpipe.release.render import headline
from cnnpipe.release.verdict import run_gate
from cnnpipe.train.checkpoint import UnsafeCheckpoint
from cnnpipe.train.distributed import resolve_device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--champion", default="models/champion", help="the champion stage's output")
    parser.add_argument("--challenger", default="models/optimized", help="the challenger's best.pt folder")
    parser.add_argument("--metrics", default="metrics/optimized", help="evaluate's eval.json for the challenger")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--data-report", default="metrics/data_report.json", help="prepare's report: the week's relabels")
    parser.add_argument("--delivery", default="metrics/delivery.json", help="the delivery check's report, repeated")
    parser.add_argument("--held-out", default="data/delivery/flagged.csv",
                        help="the delivery check's list: the photos it holds out (policy hold_out) are left out")
    parser.add_argument("--out", default="metrics", help="gate.json and gate.md go here")
    args = parser.parse_args()
    try:
        raw = load_params(args.params)
        device = resolve_device(resolve(raw, "optimized").train.device)
        verdict = run_gate(release_config(raw), Path(args.champion), Path(args.challenger), Path(args.metrics),
                           Path(args.data), Path(args.out), device, Path(args.data_report),
                           delivery=Path(args.delivery), held_out=Path(args.held_out))
    except (ParamsError, UnsafeCheckpoint, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"gate: {exc}", file=sys.stderr)
        return 2
    print(f"gate: {headline(verdict)}")
    for line in verdict["warnings"] + verdict["reasons"]:
        print(f"gate:   {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
