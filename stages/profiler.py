"""profile stage: breakdown, trace, bottleneck and knob trials for one variant."""

import argparse
import sys
import time
from pathlib import Path

from cnnpipe.config import ParamsError, load_params, resolve
from cnnpipe.distributed import init_distributed
from cnnpipe.profiling import profile_variant, save_profile, summary
from cnnpipe.trainer import set_threads


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
        cfg = resolve(load_params(args.params), args.variant)
    except ParamsError as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.train.device)
    set_threads(cfg, info)
    t0 = time.perf_counter()
    result = profile_variant(cfg, info, Path(args.data), Path(args.logs) / args.variant, not args.no_trials)
    result["stage_time_s"] = time.perf_counter() - t0
    save_profile(result, Path(args.metrics))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
