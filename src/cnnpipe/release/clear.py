"""`python -m cnnpipe.release.clear`: clear photos the delivery check flagged or holds out, on record.

A person who looked at the listed photos and found their labels right clears them: their sha256 and
a note go into `data/delivery/cleared.csv`, the committed file that `prepare` (which then ends their
hold in the split ledger) and the delivery stage (which then lists them as `cleared`, never held)
read. Commit it and rerun `dvc repro gate`. Which photos: `--sha256 HEX ...`, or every open row of
the list (`--all`), narrowed by `--given CLASS` and `--predicted CLASS`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from cnnpipe.data.splits.held_out import CLEARED_COLUMNS, read_cleared, sha256_column


def open_rows(list_path: Path, given: str | None = None, predicted: str | None = None) -> list[dict[str, str]]:
    """The rows of the delivery list still open (flagged or held, not cleared), filtered by class."""
    if not list_path.exists():
        raise FileNotFoundError(f"{list_path} not found: run `dvc repro delivery` (or `dvc pull {list_path}`) first")
    with open(list_path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    return [r for r in rows if r.get("status", "flagged") != "cleared" and (given is None or r["given"] == given)
            and (predicted is None or r["predicted"] == predicted)]


def clear(cleared: Path, digests: list[str], note: str) -> int:
    """Append each of `digests` (hex sha256) not yet in `cleared` with `note`; returns how many were new."""
    sha256_column(digests, Path("the photos to clear"), range(1, len(digests) + 1))  # before anything is written
    raw = read_cleared(cleared).tobytes()  # (not .tolist(): numpy drops a digest's trailing zero bytes)
    done = {raw[k : k + 32].hex() for k in range(0, len(raw), 32)}
    new = list(dict.fromkeys(d for d in digests if d not in done))
    fresh_file = not cleared.exists() or cleared.stat().st_size == 0
    cleared.parent.mkdir(parents=True, exist_ok=True)
    with open(cleared, "a", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        if fresh_file:
            writer.writerow(CLEARED_COLUMNS)
        writer.writerows([d, note] for d in new)
    return len(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.release.clear", description=__doc__.split("\n")[0])
    parser.add_argument("--list", type=Path, default=Path("data/delivery/flagged.csv"), help="the delivery list")
    parser.add_argument("--cleared", type=Path, default=Path("data/delivery/cleared.csv"))
    parser.add_argument("--note", required=True, help="who looked, and why the labels are right (kept in the file)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--sha256", nargs="+", metavar="HEX", help="the photos to clear, as the list gives them")
    which.add_argument("--all", action="store_true", help="every open row of the list (see --given, --predicted)")
    parser.add_argument("--given", help="with --all: only photos filed under this class")
    parser.add_argument("--predicted", help="with --all: only photos the champion called this class")
    args = parser.parse_args(argv)
    try:
        digests = ([d.strip().lower() for d in args.sha256] if args.sha256 else
                   [r["sha256"] for r in open_rows(args.list, args.given, args.predicted)])
        added = clear(args.cleared, digests, args.note)
    except (FileNotFoundError, ValueError) as exc:
        print(f"clear: {exc}", file=sys.stderr)
        return 2
    print(f"clear: {added} photo(s) added to {args.cleared} ({len(digests) - added} already there); commit it and "
          "rerun `dvc repro gate`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
