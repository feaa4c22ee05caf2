"""Every fenced block of README.md and docs/*.md is run by a test or declared not run, and why
(tests/doc_blocks.yaml): a new block listed nowhere fails here, as does an entry whose block is gone
or whose test does not exist. Every python block's imports are executed, and the self-contained
python blocks the manifest gives to this file run whole."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MANIFEST = ROOT / "tests" / "doc_blocks.yaml"
Key = tuple[str, str, str, int]  # file, heading, language, place among that heading's blocks of that language


def fenced_blocks(doc: Path) -> dict[Key, str]:
    """The fenced blocks of `doc`, keyed as the manifest names them."""
    blocks: dict[Key, str] = {}
    heading, lines, i = "", doc.read_text(encoding="utf-8").split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#{1,6} ", line):
            heading = line
        elif line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            n = sum(1 for k in blocks if k[1:3] == (heading, lang))
            blocks[(doc.relative_to(ROOT).as_posix(), heading, lang, n)] = "\n".join(body) + "\n"
        i += 1
    return blocks


def every_block() -> dict[Key, str]:
    return {k: v for doc in DOCS for k, v in fenced_blocks(doc).items()}


def manifest() -> dict[Key, dict]:
    entries = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    return {(e["file"], e["heading"], e["lang"], e["n"]): e for e in entries}


def test_every_block_is_run_or_declared():
    found, listed = every_block(), manifest()
    missing = [k for k in found if k not in listed]
    assert not missing, "fenced blocks neither run by a test nor declared in tests/doc_blocks.yaml:\n" + "\n".join(
        f"- {{file: {f}, heading: {h!r}, lang: {lang!r}, n: {n}, run_by: TEST or not_run: WHY}}"
        for f, h, lang, n in missing)
    stale = [k for k in listed if k not in found]
    assert not stale, f"tests/doc_blocks.yaml names blocks that are gone: {stale}"
    for key, entry in listed.items():
        assert ("run_by" in entry) != ("not_run" in entry), f"{key}: give run_by or not_run, one of them"
        if "not_run" in entry:
            assert len(entry["not_run"].split()) >= 4, f"{key}: say why it is not run"
            continue
        path, _, name = entry["run_by"].partition("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {re.escape(name)}\(", source, flags=re.MULTILINE), f"{key}: no test {entry['run_by']}"
        assert key[1] in source, f"{key}: {path} never names the heading {key[1]!r}, so it cannot read the block"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}


def test_python_blocks_import_and_the_ones_marked_here_run(tmp_path):
    """Each python block's imports run (an API renamed under a block breaks here, not in a reader's
    shell); the blocks this file is named for run whole, their `/tmp/newphotos` in a folder of the test's."""
    here = "tests/test_doc_blocks.py::"
    # "## The gate": docs/weekly-loop.md's heading, read here by the loop below
    # "# Using the model: predict and export": docs/using-the-model.md's, the block run whole below
    listed = manifest()
    for key, block in every_block().items():
        if key[2] != "python":
            continue
        imports = [ast.unparse(node) for node in ast.walk(ast.parse(block))
                   if isinstance(node, (ast.Import, ast.ImportFrom))]
        run = subprocess.run([sys.executable, "-c", "\n".join(imports)], env=_env(), capture_output=True, text=True)
        assert run.returncode == 0, f"{key}: its imports fail:\n{run.stderr[-2000:]}"
        if listed[key].get("run_by", "").startswith(here):
            photos = tmp_path / "newphotos"
            photos.mkdir()
            run = subprocess.run([sys.executable, "-c", block.replace("/tmp/newphotos", str(photos))], env=_env(),
                                 capture_output=True, text=True, cwd=tmp_path)
            assert run.returncode == 0, f"{key} fails:\n{run.stderr[-2000:]}"
            assert len(list(photos.glob("*.jpg"))) == 25  # the 24 items and the noise the text says it wrote


def test_copies_of_a_run_block_hold_its_commands():
    """A block that repeats one a test runs holds the same commands: docs/data.md's own-images recipe
    ("### Together, and what is not a photo") is the README's "## Your own images"; docs/weekly-loop.md's
    week and serving machine ("## The commands") are the README's weekly ones, which
    test_user_commands' newcomer runs; docs/profiling.md's tensorboard line ("# Profiling") is the
    README's "## Everyday use" one, which test_profile serves."""
    blocks = every_block()

    def commands(block: str) -> list[str]:
        return [re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).strip() for line in block.splitlines()
                if line.strip() and not line.lstrip().startswith("#") and not line.startswith("|")]

    readme_own = blocks[("README.md", "## Your own images", "bash", 0)]
    data_own = blocks[("docs/data.md", "### Together, and what is not a photo", "bash", 0)]
    assert commands(data_own) == commands(readme_own)
    # docs/weekly-loop.md's week: the photos copied in, the README's week (`&&` on lines of their own), a look
    # at gate.md; its serving machine: the README's `fetch` (another URL), then predict.
    def steps(block: str) -> list[str]:
        return [s.strip() for c in commands(block) for s in c.split("&&")]

    readme_week = steps(blocks[("README.md", "## Every week: retrain, gate, promote", "bash", 1)])
    docs_week = steps(blocks[("docs/weekly-loop.md", "## The commands", "bash", 0)])
    assert [s for s in docs_week if not s.startswith(("cp ", "cat "))] == readme_week[:-1]
    docs_fetch = steps(blocks[("docs/weekly-loop.md", "## The commands", "bash", 1)])
    fetch, readme_fetch = docs_fetch[0].split(), readme_week[-1].split()
    assert fetch[:3] == readme_fetch[:3] and fetch[4:] == readme_fetch[4:]  # the URL aside
    [tensorboard] = [c for c in commands(blocks[("README.md", "## Everyday use", "console", 0)])
                     if c.startswith("tensorboard")]
    assert commands(blocks[("docs/profiling.md", "# Profiling", "bash", 0)]) == [tensorboard]


def test_the_clone_tiers_overrides_are_each_listed_with_why():
    """docs/testing.md's table names every `-S` override the clone tier appends to the README's command
    (the shared run's and the manifest route's), and nothing else, each with a reason."""
    from test_user_commands import AT_THE_READMES_SIZES, TINY

    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \| (.+?) \|$", text, flags=re.MULTILINE)
    assert {key for key, _, _ in rows} == {flag.split("=", 1)[0] for flag in TINY + AT_THE_READMES_SIZES}
    assert all(len(why.split()) >= 3 and kind in ("time", "environment", "a user's knob") for _, why, kind in rows)
