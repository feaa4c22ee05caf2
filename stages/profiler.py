"""profile stage: breakdown, trace, bottleneck and knob trials for one variant."""

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from cnnpipe.config import ParamsError, load_params, resolve
from cnnpipe.distributed import init_distributed
from cnnpipe.profiling import profile_variant
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
    out = Path(args.metrics)
    out.mkdir(parents=True, exist_ok=True)
    tuned = result["tuned"]
    (out / f"{args.variant}.json").write_text(json.dumps(result, indent=2) + "\n")
    # Only the knobs the variant leaves at `auto`: explicit recipes get an empty, stable file.
    (out / f"{args.variant}_tuned.yaml").write_text(yaml.safe_dump(tuned, sort_keys=True))
    shares = ", ".join(f"{k} {v:.0%}" for k, v in result["fractions"].items() if v >= 0.01)
    print(f"profile[{args.variant}]: {result['step_time_median_s'] * 1000:.0f} ms/step, "
          f"{result['throughput_img_s']:.0f} img/s; {shares}; bottleneck: {result['bottleneck']}")
    for rec in result["recommendations"]:
        print(f"  - {rec['action']}  (evidence: {rec['evidence']})")
    for trial in result["trials"] + ([result["combined_trial"]] if result["combined_trial"] else []):
        low, high = trial["speedup_range"]
        print(f"  trial {trial['change']}: {trial['speedup']:.2f}x ({low:.2f}-{high:.2f})"
              f"{' WIN' if trial['win'] else ''} {trial['note']}".rstrip())
    if tuned:
        print(f"  tuned (for the `auto` params): {tuned}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
