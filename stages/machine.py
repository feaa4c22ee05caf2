"""machine stage: the fingerprint of this machine (CPU, cores, GPUs, torch/CUDA), the profiles' input.

Always runs (it is cheap); DVC reruns the profiles and the plan only when the file's content changes.
"""

import argparse
import sys
from pathlib import Path

from cnnpipe.files import write_json
from cnnpipe.hardware import machine_fingerprint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="metrics/machine.json")
    args = parser.parse_args()
    fingerprint = machine_fingerprint()
    write_json(Path(args.out), fingerprint)
    cpu = fingerprint["cpu"]
    print(f"machine: {cpu['model']}, {cpu['usable_cores']} cores ({', '.join(cpu['features']) or 'no AVX'}), "
          f"GPUs: {', '.join(fingerprint['gpus']) or 'none'}, torch {fingerprint['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
