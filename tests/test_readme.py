"""The README is for users: short, no project diary, and its numbers are the committed metrics'."""

import json
import re

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_short_and_reads_as_documentation():
    assert len(README.splitlines()) <= 250
    diary = re.findall(r"issue \d+|\bsessions?\b|commit [0-9a-f]{7}", README, flags=re.IGNORECASE)
    assert not diary, diary
    for doc in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / doc).exists(), f"README links to {doc}, which does not exist"


def test_the_results_table_is_the_committed_comparison():
    """Every table row in the README's Results section is a row of metrics/compare.md as committed."""
    compare_md = (ROOT / "metrics" / "compare.md").read_text().splitlines()
    rows = [line for line in _section("Results").splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 8
    for row in rows:
        assert row in compare_md, f"README row not in metrics/compare.md (rerun `dvc repro` and copy it): {row}"


def test_the_everyday_example_shows_the_committed_metrics():
    compare = json.loads((ROOT / "metrics" / "compare.json").read_text())
    block = _section("Everyday use")
    assert f"{compare['speedup_throughput']:.4f}".rstrip("0") in block
    assert f"{compare['top1_delta']:.4f}".rstrip("0") in block


def test_distributed_docs_name_the_configured_link_type_and_set_nnodes_before_the_plan():
    """docs/distributed.md: the cache link type is `.dvc/config`'s; `train.nnodes` is set before `dvc repro
    plan` (both are params of the profiles and the plan); the SLURM block puts the venv on PATH for `dvc`."""
    import configparser

    config = configparser.ConfigParser()
    config.read_string((ROOT / ".dvc" / "config").read_text())
    link_type = config["cache"]["type"].strip('"')
    doc = (ROOT / "docs" / "distributed.md").read_text()
    named = re.findall(r'`type = "([^"]+)"` under `\[cache\]`', doc)
    assert named == [link_type], (named, link_type)
    assert "reflink" not in doc.split("### Data on every node", 1)[1].split("###", 1)[0]
    recipe = doc.split("## Several machines", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert recipe.index("train.nnodes") < recipe.index("dvc repro plan")
    srun = doc.split("srun ", 1)[1].split("```", 1)[0]
    assert srun.index("source .venv/bin/activate") < srun.index("dvc pull")
