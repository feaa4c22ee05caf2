"""export stage: the best checkpoint to TorchScript and ONNX, with a parity check on the test split."""

import argparse
import sys
from pathlib import Path

from cnnpipe.deploy.export import OPSET, export_model
from cnnpipe.train.budget import export_batch, read_budget


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant", nargs="?", default="optimized")
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--out", type=Path, default=Path("exports"), help="files go to <out>/<variant>/")
    parser.add_argument("--metrics", type=Path, default=Path("metrics"), help="<metrics>/<variant>/export.json")
    parser.add_argument("--budget", type=Path,
                        help="the plan's budget.yaml: its parity_images, when set, caps the check; its "
                        "export_batch is the batch the check runs at")
    parser.add_argument("--max-images", type=int, help="parity on a class-balanced N of the test images (default: all)")
    args = parser.parse_args(argv)
    try:
        budget = read_budget(args.budget)
        caps = [n for n in (args.max_images, budget.get("parity_images")) if n is not None]
        limit = min(caps) if caps else None
        result = export_model(args.models / args.variant, args.data, args.out / args.variant,
                              args.metrics / args.variant / "export.json", limit, export_batch(budget, args.variant))
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"export[{args.variant}]: {exc}", file=sys.stderr)
        return 2
    onnx, script = result["onnx"], result["torchscript"]
    print(f"export[{args.variant}]: {args.out / args.variant}/model.ts + model.onnx (opset {OPSET}); "
          f"PyTorch top-1 {result['pytorch_top1']:.4f} on {result['images']} test images; TorchScript "
          f"agrees {script['top1_agreement']:.2%} (max |diff| {script['max_abs_diff']:.2e})"
          + (f"; ONNX agrees {onnx['top1_agreement']:.2%} (max |diff| {onnx['max_abs_diff']:.2e})" if onnx else "")
          + f"; checked with {result['onnx_checker']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
