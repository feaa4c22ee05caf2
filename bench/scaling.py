"""Benchmark: DDP scaling of the train stage, 1..N processes through the real torchrun.

Prepares a capped copy of the data set, trains one short epoch of the optimized recipe with
`train.nproc` = 1..N (threads split evenly over the cores), reads throughput from each train.json
and prints T_N / T_1 (CPU: the processes share the cores) and scaling_efficiency = T_N / (N * T_1)
(GPUs: a device each).

    python bench/scaling.py                      # N = 1, 2 on this machine, 4096 images
    python bench/scaling.py --max-procs 8 --images 50000 --epochs 2   # a GPU node
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from cnnpipe.data.prepare import prepare
from cnnpipe.params import data_config, load_params

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default=str(ROOT / "params.yaml"))
    parser.add_argument("--max-procs", type=int, default=2)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split across processes")
    args = parser.parse_args()
    raw = load_params(args.params)
    raw["data"]["max_train_images"] = args.images
    raw["data"]["max_eval_images"] = 512
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(data_config(raw), raw["seed"], work / "prepared", work / "report.json")
        throughput = {}
        for n in range(1, args.max_procs + 1):
            params = dict(raw)
            params["train"] = dict(raw["train"], epochs=args.epochs, nproc=n, batch_size=args.batch_size // n,
                                   rdzv_endpoint="127.0.0.1:29400")
            params["variants"] = {"optimized": raw["variants"]["optimized"]}
            (work / f"p{n}.yaml").write_text(yaml.safe_dump(params))
            subprocess.run([sys.executable, str(ROOT / "stages" / "train.py"), "optimized", "--params",
                            str(work / f"p{n}.yaml"), "--data", str(work / "prepared"), "--models",
                            str(work / f"m{n}"), "--metrics", str(work / f"x{n}")], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            summary = json.loads((work / f"x{n}" / "optimized" / "train.json").read_text())
            throughput[n] = summary["throughput_img_s"]
            eff = throughput[n] / (n * throughput[1])
            # On a CPU the N processes share the cores one process used: T_N / T_1 is what the plan
            # multiplies by (plan/scaling.py CPU_SHARED_CORES); on GPUs (a device each) it is N x efficiency.
            print(f"nproc={n}: {throughput[n]:.0f} img/s, {summary['threads_per_process']} threads/process, "
                  f"T_N/T_1={throughput[n] / throughput[1]:.2f}, scaling_efficiency={eff:.2f}", flush=True)


if __name__ == "__main__":
    main()
