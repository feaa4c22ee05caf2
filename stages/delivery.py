"""delivery stage: this week's new photos against the champion, before training.

Writes metrics/delivery.json and the list of flagged photos (data/delivery/flagged.csv). With
`release.delivery.policy: stop` and a flag it exits 1 after writing both, so `dvc repro` stops
before training and the message names the list. With no champion yet it says so and passes.
"""

import argparse
import sys
from pathlib import Path

from cnnpipe.data.sources.entries import DataError
from cnnpipe.data.splits.holds import last_list, read_held_list
from cnnpipe.params import ParamsError, load_params, release_config, resolve
from cnnpipe.release.delivery import check_delivery, summary, write_delivery
from cnnpipe.train.checkpoint import UnsafeCheckpoint
from cnnpipe.train.distributed import resolve_device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--champion", default="models/champion", help="the champion stage's output")
    parser.add_argument("--out", default="metrics/delivery.json")
    parser.add_argument("--list", default="data/delivery/flagged.csv", help="every flagged photo, one CSV row each")
    parser.add_argument("--cleared", default="data/delivery/cleared.csv",
                        help="sha256 of flagged photos a person cleared (a committed CSV: sha256,note)")
    args = parser.parse_args(argv)
    try:
        raw = load_params(args.params)
        cfg = release_config(raw)
        device = resolve_device(resolve(raw, "optimized").train.device)
        # The last check of this same store: its holds stand until a prepare records them in the ledger.
        previous, _ = last_list(Path(args.list), Path(args.data), recheck=False)
        report, files = check_delivery(Path(args.data), Path(args.champion), cfg, device, Path(args.cleared),
                                       read_held_list(previous))
    except (ParamsError, UnsafeCheckpoint, DataError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"delivery: {exc}", file=sys.stderr)
        return 2
    write_delivery(report, files, Path(args.out), Path(args.list))
    for line in summary(report):
        print(f"delivery: {line}")
    for name in report["files"][:10]:
        print(f"delivery:   {name}")
    if report.get("held_from_earlier_weeks"):
        print(f"delivery: {report['held_from_earlier_weeks']} photo(s) flagged in an earlier week are still held out "
              f"(status held in {args.list}): fix their labels in the catalog, or clear them in {args.cleared}")
    if report.get("cleared"):
        print(f"delivery: {report['cleared']} flagged photo(s) cleared in {args.cleared}: not held out")
    fresh = sum(f["status"] == "flagged" for f in files)
    if report["flagged"] or report.get("open_flags"):
        more = f" (the first {len(report['files'])} in {args.out})" if report["files"] else ""
        print(f"delivery: every flagged photo is listed in {args.list}{more}")
        if cfg.delivery.policy == "hold_out" and report.get("open_flags"):
            print(f"delivery: {report['open_flags']} photo(s) held out of training, validation and the test split; "
                  "`python -m cnnpipe.promote` asks for --accept-flagged while any is open")
        if cfg.delivery.policy == "stop" and fresh:
            print(f"delivery: STOP (release.delivery.policy: stop): training does not start. Fix the labels of the "
                  f"photos listed in {args.list} in the catalog, or rerun with `-S release.delivery.policy=report`",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
