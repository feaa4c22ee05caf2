"""train stage: fine-tune one variant; relaunches itself under torchrun when train.nproc > 1.

Params are read from params.yaml directly (not dvc.api.params_show, which takes DVC's lock and
fails under torchrun).
"""

import argparse
import sys
from pathlib import Path

from cnnpipe.files import DiskFull
from cnnpipe.models import WeightsUnavailable
from cnnpipe.params import ParamsError, load_params, resolve
from cnnpipe.train.budget import apply_budget, eval_batch, read_budget
from cnnpipe.train.checkpoint import UnsafeCheckpoint
from cnnpipe.train.distributed import ConfigMismatch, cleanup, init_distributed
from cnnpipe.train.engine import NonFiniteLoss
from cnnpipe.train.launch import needs_torchrun, relaunch, stop_without_restart
from cnnpipe.train.trainer import fit
from cnnpipe.train.tuning import read_tuned


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", default="data/prepared")
    parser.add_argument("--models", default="models", help="checkpoints go to <models>/<variant>/")
    parser.add_argument("--metrics", default="metrics", help="train.json goes to <metrics>/<variant>/")
    parser.add_argument("--tuned", default=None, help="the profile's tuned values for `auto` knobs "
                        "(default: <metrics>/profile/<variant>_tuned.yaml when it exists)")
    parser.add_argument("--budget", default=None, help="the plan's images per epoch under the budget and "
                        "validation batch (default: <metrics>/plan/budget.yaml when it exists)")
    parser.add_argument("--champion", default="models/champion",
                        help="the model in production, for model.init: champion (the champion stage's output)")
    parser.add_argument("--held-out", default="data/delivery/flagged.csv",
                        help="the delivery check's list: the photos it holds out (policy hold_out) are left out")
    parser.add_argument("--nnodes", type=int, help="override train.nnodes (e.g. $SLURM_NNODES)")
    parser.add_argument("--node-rank", type=int, help="override train.node_rank (e.g. $SLURM_NODEID)")
    parser.add_argument("--rdzv-endpoint", help="override train.rdzv_endpoint (host:port of node 0)")
    args = parser.parse_args()
    # Every node runs this same command and reads the same committed files: the standard paths are
    # the defaults, so a node started without the flags cannot train another config.
    tuned = Path(args.tuned or Path(args.metrics) / "profile" / f"{args.variant}_tuned.yaml")
    budget = Path(args.budget or Path(args.metrics) / "plan" / "budget.yaml")
    try:
        cfg = resolve(load_params(args.params), args.variant)
        overrides = {k: v for k, v in (("nnodes", args.nnodes), ("node_rank", args.node_rank),
                                       ("rdzv_endpoint", args.rdzv_endpoint)) if v is not None}
        planned = read_budget(budget)
        cfg = apply_budget(cfg.with_train(**overrides), planned)
        val_batch = eval_batch(planned, args.variant)
    except (ParamsError, ValueError) as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 2
    if needs_torchrun(cfg.train):
        return relaunch(cfg.train, __file__, sys.argv[1:], run_id=f"cnnpipe-{args.variant}")
    try:
        info = init_distributed(cfg.train.device, cfg.train.node_rank)
        fit(cfg, info, Path(args.data), Path(args.models) / args.variant,
            Path(args.metrics) / args.variant / "train.json", Path(args.metrics) / args.variant / "live",
            tuned=read_tuned(tuned) if tuned.exists() else None, champion=Path(args.champion),
            held_out=Path(args.held_out), eval_batch=val_batch)
    except ConfigMismatch as exc:  # the nodes disagree, on every rank: restarting would only repeat it
        return stop_without_restart(f"train[{args.variant}]: {exc}")
    except (WeightsUnavailable, NonFiniteLoss, UnsafeCheckpoint, DiskFull, ValueError,
            FileNotFoundError) as exc:
        print(f"train[{args.variant}]: {exc}", file=sys.stderr)
        return 2
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
