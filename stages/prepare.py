"""prepare stage: raw images → data/prepared (pre-resized, split), data/split_ledger (every image's split,
for good) + metrics/data_report.json."""

import argparse
import sys
from pathlib import Path

from cnnpipe.data.sources.idx import DatasetMissing
from cnnpipe.data.prepare import DataError, prepare
from cnnpipe.data.ingest.workers import DecodersFailed
from cnnpipe.params import ParamsError, data_config, load_params, release_config
from cnnpipe.uptime import process_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/prepared", help="prepared data directory")
    parser.add_argument("--ledger", default=None, help="split ledger directory (default: <out>_ledger)")
    parser.add_argument("--report", default="metrics/data_report.json")
    parser.add_argument("--held-out", default=None,
                        help="the last delivery list (data/delivery/flagged.csv): its held photos stay held")
    parser.add_argument("--cleared", default=None, help="sha256 of held photos a person cleared (a committed CSV)")
    args = parser.parse_args()
    try:
        raw = load_params(args.params)
        report = prepare(data_config(raw), raw.get("seed", 0), Path(args.out), Path(args.report),
                         Path(args.ledger) if args.ledger else None,
                         held_out=Path(args.held_out) if args.held_out else None,
                         cleared=Path(args.cleared) if args.cleared else None,
                         renamed=dict(release_config(raw).renamed),
                         clock=process_seconds)  # the stage's time, imports included: the plan counts it
    except (ParamsError, DataError, DatasetMissing, DecodersFailed) as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 2
    print(f"prepare: {report['splits']} ({report['num_bad']} bad files, {len(report['leakage'])} leaked duplicates)")
    if report.get("recovered"):
        print(f"prepare: {report['recovered']}")
    if report.get("work"):
        work = report["work"]
        print(f"prepare: {work['listed']} images listed: {work['decoded']} decoded, {work['kept']} kept in the "
              f"previous store's shards and {work['copied']} copied from it ({work['unchanged_not_read']} unchanged "
              f"files not read), {work['resumed']} kept from an interrupted run; {work['workers']} worker(s)")
    ledger = report["ledger"]
    if ledger.get("started"):
        print(f"prepare: {ledger['started']}")
    print(f"prepare: split ledger: {ledger['records_added']} record(s) added, {ledger['segments']} segment(s)"
          + (f"; splits redrawn ({ledger['reset']})" if ledger.get("reset") else ""))
    if report["holds"].get("list_not_read"):
        print(f"prepare: {report['holds']['list_not_read']}")
    held = sum(report["holds"]["held"].values())
    if held:
        print(f"prepare: {held} photo(s) held out by the delivery check until their label changes or they are "
              "cleared (data/delivery/cleared.csv)")
    if ledger.get("rule_changed") and not ledger.get("reset"):
        print("prepare: WARNING: the seed or the split fractions changed: images the split ledger knows keep their "
              "splits, new ones are drawn by the new rule; set data.split_reset to a new name to redraw them all",
              file=sys.stderr)
    if report.get("num_label_conflicts"):
        print(f"prepare: WARNING: {report['num_label_conflicts']} image(s) found under several labels (every copy "
              f"{'held out' if report['label_conflicts'][0]['split'] != 'quarantined' else 'quarantined'}; see "
              "label_conflicts in the data report)", file=sys.stderr)
    if report.get("num_placeholders"):
        print(f"prepare: WARNING: {report['num_placeholders']} placeholder image(s) (the same bytes in many groups or "
              "labels) left out; see placeholders in the data report", file=sys.stderr)
    for folder in report.get("skipped_folders", []):
        print(f"prepare: WARNING: skipped {folder['path']}: {folder['reason']}", file=sys.stderr)
    if report.get("changes"):
        changes = report["changes"]
        delta = ", ".join(f"{s} +{c['gained']}/-{c['lost']}" for s, c in changes["splits"].items())
        print(f"prepare: against the previous store: {delta}; {changes['moved_between_splits']} moved between splits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
