"""Promote this commit's model, the GTO way: `python -m cnnpipe.promote`.

Reads the gate's verdict (metrics/gate.json) and refuses, with exit code 2 and the reasons, when:
the model was not blessed (unless `--override "why"`, which goes into the tags), the working tree or
dvc.lock is not committed, the pipeline is not up to date with dvc.lock, or the model is not in the
DVC remote (a serving machine could not fetch it). Otherwise it registers the commit as the next
version of the artifact (`name@v0.1.0` first, then `--bump-minor`) and assigns it to the stage
(`name#prod#N`), both annotated tags carrying the gate's summary, and prints the `git push` that
publishes them. `gto show` lists the history; a rollback is `gto assign NAME --stage prod --version
vX.Y.Z --force`, which the champion stage follows on the next `dvc repro`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cnnpipe.config import ReleaseConfig
from cnnpipe.params import ParamsError, load_params, release_config
from cnnpipe.release.champion import in_stage

FIRST_VERSION = "v0.1.0"


class Refused(RuntimeError):
    """Promotion refused; the message says why and what to do."""


def _run(args: list[str], repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False)


def summary(verdict: dict[str, Any]) -> str:
    """One paragraph for the tag message: the verdict and its reasons."""
    return f"gate: {'blessed' if verdict['blessed'] else 'REFUSED'}. " + " ".join(
        reason.rstrip(".") + "." for reason in verdict["reasons"])


def check_ready(repo: Path, model_stage: str, gate: Path) -> None:
    """Refuse unless the tree is committed (dvc.lock and the verdict included), the pipeline matches
    dvc.lock and the model is pushed."""
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    if dirty.returncode != 0:
        raise Refused(f"{repo} is not a git repository: {dirty.stderr.strip()}")
    tracked = _run(["git", "ls-files", "--error-unmatch", "dvc.lock", str(gate.resolve().relative_to(repo))], repo)
    if tracked.returncode != 0:
        raise Refused(f"dvc.lock and {gate} must be committed with the model: {tracked.stderr.strip()}")
    if dirty.stdout.strip():
        raise Refused("the working tree has uncommitted changes (dvc.lock, metrics, code?):\n"
                      f"{dirty.stdout.rstrip()}\ncommit them first: the version must name the commit that made it")
    # The gate and everything it stands on (prepare, train@optimized, evaluate@optimized): a weekly run
    # may leave the baseline's stages behind.
    status = _run([sys.executable, "-m", "dvc", "status", "--json", "--with-deps", "gate"], repo)
    stale = {} if status.returncode else {stage: changes for stage, changes in json.loads(status.stdout or "{}").items()
                                          if changes != ["always changed"]}  # the machine and champion stages
    if status.returncode or stale:
        raise Refused(f"the gate or the model is not up to date with dvc.lock ({', '.join(stale) or status.stderr.strip()}"
                      "): run `dvc repro gate` and commit")
    cloud = _run([sys.executable, "-m", "dvc", "status", "--cloud", "--json", model_stage], repo)
    if cloud.returncode != 0:
        raise Refused(f"cannot check the DVC remote: {cloud.stderr.strip()}: configure one (`dvc remote add -d ...`)")
    if json.loads(cloud.stdout or "{}"):
        raise Refused("the model is not in the DVC remote yet: run `dvc push` (a serving machine fetches it from there)")


def check_same_champion(repo: Path, cfg: ReleaseConfig, verdict: dict[str, Any]) -> None:
    """Refuse a verdict judged against another champion than the one in the stage now (the stage
    moved since `dvc repro gate`, or the gate ran where the tags were not fetched)."""
    now = in_stage(repo, cfg.artifact, cfg.stage)
    judged = verdict.get("champion") or {}
    if (now or {}).get("commit") != judged.get("commit"):
        raise Refused(f"the gate judged against {judged.get('version') or 'no champion'}, but {cfg.stage!r} now holds "
                      f"{(now or {}).get('version') or 'nothing'}: `git fetch --tags`, rerun `dvc repro gate` and commit")


def promote(repo: Path, cfg: ReleaseConfig, verdict: dict[str, Any], override: str | None = None,
            model_stage: str = "train@optimized", gate: Path = Path("metrics/gate.json")) -> tuple[str, list[str]]:
    """Register and assign; returns the version and the tags created."""
    import gto.api
    from gto.exceptions import GTOException

    if not verdict["blessed"] and not override:
        raise Refused("the gate did not bless this model:\n" + "\n".join(f"  - {r}" for r in verdict["reasons"])
                      + "\nfix the data or the recipe, or promote anyway with --override \"why\" (recorded in the tags)")
    check_same_champion(repo, cfg, verdict)
    check_ready(repo, model_stage, repo / gate)
    message = summary(verdict)
    if override:
        who = _run(["git", "config", "user.name"], repo).stdout.strip() or "unknown"
        message = f"OVERRIDE by {who}: {override}. {message}"
    try:
        first = gto.api.find_latest_version(str(repo), cfg.artifact) is None
    except GTOException:
        first = True
    try:
        registered = gto.api.register(str(repo), cfg.artifact, "HEAD", message=message,
                                      **({"version": FIRST_VERSION} if first else {"bump_minor": True}))
        assigned = gto.api.assign(str(repo), cfg.artifact, cfg.stage, version=registered.version, message=message)
    except GTOException as exc:
        raise Refused(f"GTO refused: {exc}") from exc
    return registered.version, [registered.tag, assigned.tag]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.promote", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("."), help="the project (paths below are inside it)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--gate", type=Path, default=Path("metrics/gate.json"), help="the gate stage's verdict")
    parser.add_argument("--override", metavar="WHY", help="promote a model the gate refused; WHY goes into the tags")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    try:
        cfg = release_config(load_params(repo / args.params))
        if not (repo / args.gate).exists():
            raise Refused(f"{args.gate} not found: run `dvc repro gate` first")
        verdict = json.loads((repo / args.gate).read_text())
        version, tags = promote(repo, cfg, verdict, args.override, gate=args.gate)
    except (Refused, ParamsError) as exc:
        print(f"promote: REFUSED: {exc}", file=sys.stderr)
        return 2
    print(f"promote: {cfg.artifact} {version} is now in {cfg.stage!r} ({', '.join(tags)})")
    print("promote: publish it with: git push origin " + " ".join(f"'{t}'" for t in tags))
    return 0
