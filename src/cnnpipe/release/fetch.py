"""`python -m cnnpipe.release.fetch REPO -o model/best.pt`: the model in production, for a serving machine.

The same resolution as the champion stage and promote (`production.in_stage`: GTO's rules, with
deprecations, deregistrations and unassignments, same-second events ordered by GTO's counter), on a
fresh clone of REPO's tags, then the model at that version's commit from the DVC remote. `dvc
artifacts get --stage prod` instead takes the newest tag naming the stage, unassignments included,
and can serve another version than the gate judged against.

Served only if it is what was judged: the downloaded bytes' md5 must be the one that version's
commit records in `dvc.lock` (through the model folder's listing, itself checked against dvc.lock:
`release.remote.Remote`), else it refuses, naming both md5s, and the file already at `-o` stays as it was.
Writes the model and, beside it, release.json (version, commit, tag, md5).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.files import write_json
from cnnpipe.release.champion import Mismatch, artifact_path, committed_lock, download
from cnnpipe.release.production import ProductionUnknown, artifact_events, git, in_stage
from cnnpipe.release.remote import ModelUnchecked, Remote


def fetch_production(url: str, artifact: str, stage: str, out: Path) -> dict:
    """Resolve `stage` of `artifact` in the git repository `url` and download its model to `out`."""
    with tempfile.TemporaryDirectory(prefix="cnnpipe-fetch-") as tmp:
        clone = Path(tmp) / "repo"
        source = str(Path(url).resolve()) if Path(url).exists() else url  # a relative path, from here
        git(Path(tmp), "clone", "--quiet", "--no-checkout", source, str(clone))
        found = in_stage(artifact_events(clone, artifact), artifact, stage)
        if found is None:
            raise ProductionUnknown(f"no version of {artifact!r} is in {stage!r} in {url}")
        commit = found["commit"]
        path = artifact_path(None, artifact, git(clone, "show", f"{commit}:dvc.yaml").stdout)
        lock = committed_lock(clone, commit, found["version"])
        with Remote(clone, rev=commit) as remote:
            expected = remote.recorded_md5(lock, path)
            stored = remote.odb.oid_to_path(expected)
        try:
            digest = download(str(clone), path, commit, out, md5=expected)
        except Mismatch as exc:
            raise Mismatch(f"{exc}: the DVC remote's copy of {found['version']} is not the model that was judged. "
                           f"Delete the remote's object {stored} and run `dvc push` where the model was promoted (its "
                           "cache holds the judged bytes), then fetch again") from exc
    about = {**found, "repo": url, "path": path, "sha256": digest, "md5": expected}
    write_json(out.parent / "release.json", about)
    return about


def main(argv: list[str] | None = None) -> int:
    defaults = ReleaseConfig()
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.release.fetch", description=__doc__.split("\n")[0])
    parser.add_argument("repo", help="the project's git URL (or path)")
    parser.add_argument("-o", "--out", type=Path, default=Path("model/best.pt"))
    parser.add_argument("--artifact", default=defaults.artifact)
    parser.add_argument("--stage", default=defaults.stage)
    args = parser.parse_args(argv)
    try:
        about = fetch_production(args.repo, args.artifact, args.stage, args.out)
    except (ProductionUnknown, KeyError, ModelUnchecked) as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 2
    except Mismatch as exc:
        print(f"fetch: REFUSED: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # DVC could not fetch the model: say where it should be
        print(f"fetch: could not fetch the model at its commit ({exc.__class__.__name__}: {exc}); the DVC remote "
              "must hold it (`dvc push` where it was promoted)", file=sys.stderr)
        return 2
    print(json.dumps({k: about[k] for k in ("artifact", "stage", "version", "commit", "tag")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
