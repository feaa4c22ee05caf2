"""profile_report stage: metrics/profile/report.md and breakdown.png for every variant."""

import argparse
import sys
from pathlib import Path

from cnnpipe.params import load_params
from cnnpipe.profile.report import write_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--metrics", default="metrics/profile")
    args = parser.parse_args()
    variants = list(load_params(args.params)["variants"])
    try:
        path = write_report(Path(args.metrics), variants)
    except FileNotFoundError as exc:
        print(f"profile_report: {exc}", file=sys.stderr)
        return 2
    print(f"profile_report: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
