"""champion stage: the model in production (the GTO stage `release.stage`), fetched at its commit.

Runs on every `dvc repro` (an assignment can move without any file changing); its output changes
only when the champion does, so nothing downstream reruns otherwise. It reads the git remote's tags
first (`release.remote`) and fails, naming the fix, when what is in production cannot be told for
sure: a remote it cannot reach, tags that differ, unpublished local tags, a deprecated artifact; and
refuses a model whose md5 is not the one its commit's dvc.lock records (the old champion stays).
"""

import argparse
import sys
from pathlib import Path

from cnnpipe.params import ParamsError, load_params, release_config
from cnnpipe.release.champion import Mismatch, fetch_champion
from cnnpipe.release.production import ProductionUnknown
from cnnpipe.release.remote import ModelUnchecked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--repo", default=".", help="the git and DVC repository whose tags name the champion")
    parser.add_argument("--out", default="models/champion")
    parser.add_argument("--verdict", default="metrics/gate.json",
                        help="where the gate's verdict is committed: the champion's names the drift budget's anchor")
    args = parser.parse_args()
    try:
        cfg = release_config(load_params(args.params))
    except ParamsError as exc:
        print(f"champion: {exc}", file=sys.stderr)
        return 2
    try:
        about = fetch_champion(Path(args.repo).resolve(), cfg, Path(args.out), args.verdict)
    except (KeyError, ProductionUnknown) as exc:
        print(f"champion: {exc}", file=sys.stderr)
        return 2
    except (ModelUnchecked, Mismatch) as exc:  # not shown to be the bytes judged: never trained from or judged against
        print(f"champion: REFUSED: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # DVC could not fetch the promoted model: say what to do
        print(f"champion: could not fetch the model in {cfg.stage!r} ({exc.__class__.__name__}: {exc}). Run "
              "`dvc pull` or check the DVC remote holds it (`dvc push --all-tags` where it was promoted)",
              file=sys.stderr)
        return 2
    if about["version"] is None:
        print(f"champion: {about['reason']}" if not about.get("told") else
              f"champion: no version of {about['artifact']!r} is in {about['stage']!r}, {about['told']}")
    else:
        print(f"champion: {about['artifact']} {about['version']} in {about['stage']} "
              f"(commit {about['commit'][:12]}, {about['tag']}); the drift budget's anchor: {about['anchor']['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
