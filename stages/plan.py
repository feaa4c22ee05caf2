"""plan stage: predict every later stage's time from the profiles, and fit `run.budget_minutes` (the
epochs of `train.epochs: auto`, and the images per epoch)."""

import argparse
import json
import sys
from pathlib import Path

import yaml

from cnnpipe.data.store.shards import read_index
from cnnpipe.files import write_json, write_text
from cnnpipe.hardware import cpu_report
from cnnpipe.params import ParamsError, load_params, resolve, run_config
from cnnpipe.plan.plan import budget_values, make_plan, recipe_from_profile
from cnnpipe.plan.text import to_text
from cnnpipe.train.budget import read_budget


def prepare_seconds(report: Path) -> dict[str, float]:
    """{"prepare": seconds} as prepare's report measured them ({} from a report that predates it)."""
    seconds = json.loads(report.read_text()).get("stage_time_s") if report.exists() else None
    return {"prepare": float(seconds)} if seconds is not None else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--profiles", default="metrics/profile", help="holds <variant>.json from the profile stages")
    parser.add_argument("--out", default="metrics/plan", help="plan.json, plan.md and budget.yaml go here")
    parser.add_argument("--data-report", default="metrics/data_report.json",
                        help="prepare's report: the seconds it took count in the budget")
    args = parser.parse_args()
    out = Path(args.out)
    try:
        raw = load_params(args.params)
        budget = run_config(raw)
        cfgs = [resolve(raw, name) for name in raw["variants"]]
        recipes = []
        for cfg in cfgs:
            path = Path(args.profiles) / f"{cfg.variant}.json"
            if not path.exists():
                raise FileNotFoundError(f"{path} not found: run `dvc repro profile@{cfg.variant}` first")
            recipes.append(recipe_from_profile(cfg, json.loads(path.read_text())))
        splits = read_index(Path(args.data))["splits"]
        requested = {c.train.images_per_epoch for c in cfgs}
        previous = read_budget(out / "budget.yaml")  # its choice is kept while it still fits (hysteresis)
        plan = make_plan(recipes, splits["train"]["count"], splits["val"]["count"], splits["test"]["count"],
                         budget.budget_minutes, requested_images=min((r for r in requested if r), default=None),
                         previous=previous, spent=prepare_seconds(Path(args.data_report)))
    except (ParamsError, FileNotFoundError, ValueError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    plan["cpu"] = cpu_report()
    write_json(out / "plan.json", plan)
    text = to_text(plan)
    write_text(out / "plan.md", text)
    write_text(out / "budget.yaml", "# Written by the plan stage; train, evaluate and export depend on it.\n"
               + yaml.safe_dump(budget_values(plan), sort_keys=True))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
