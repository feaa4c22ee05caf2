"""profile stage: breakdown, trace, bottleneck and knob trials for one variant."""

import argparse
import os
import sys
from pathlib import Path

# torch's memory profiler logs a C++ warning on every trace about blocks allocated before it started
# (every training loop has them); set before torch loads, and only warnings go (errors still print).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from cnnpipe.models import WeightsUnavailable
from cnnpipe.uptime import process_seconds
from cnnpipe.params import ParamsError, load_params, resolve, run_config
from cnnpipe.profile.run import profile_variant, save_profile, summary
from cnnpipe.train.distributed import init_distributed
from cnnpipe.train.parts import set_threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--logs", default="logs/profile", help="traces go to <logs>/<variant>/")
    parser.add_argument("--metrics", default="metrics/profile")
    parser.add_argument("--no-trials", action="store_true", help="skip the knob trials")
    args = parser.parse_args()
    try:
        raw = load_params(args.params)
        cfg, budget = resolve(raw, args.variant), run_config(raw).budget_minutes
    except ParamsError as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 2
    share = cfg.profile.budget_share
    time_box_s = budget * 60 * share if budget is not None and share is not None else None
    info = init_distributed(cfg.train.device)
    set_threads(cfg, info)
    try:
        result = profile_variant(cfg, info, Path(args.data), Path(args.logs) / args.variant, not args.no_trials,
                                 time_box_s)
    # no prepared data, a batch larger than the split; weights that do not fit (the profile builds the
    # model first: the same one-line refusal and exit 2 the train stage gives, not a traceback)
    except (FileNotFoundError, ValueError, WeightsUnavailable) as exc:
        print(f"profile[{args.variant}]: {exc}", file=sys.stderr)
        return 2
    result["stage_time_s"] = process_seconds()  # imports included: what the stage cost the run
    save_profile(result, Path(args.metrics))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
