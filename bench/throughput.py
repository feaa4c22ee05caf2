"""Benchmark: training-step throughput of a timm model per precision and memory format.

Times forward+backward+SGD step on synthetic input (warm-up steps excluded, device synchronised,
median of the timed steps) for fp32 / bf16 (and fp16 on CUDA), NCHW / channels_last, at each size.

    python bench/throughput.py                              # resnet50, 32 and 64 px, CPU
    python bench/throughput.py --sizes 64 --batch 64 --steps 6 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from cnnpipe.train.precision import autocast, use_cudnn_autotuner


def step_time(model_name: str, size: int, batch: int, amp: str, channels_last: bool, device: torch.device,
              steps: int, warmup: int, in_chans: int, compile_mode: str | None = None) -> float:
    """Median seconds per training step (compilation happens in the warm-up steps)."""
    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=10, in_chans=in_chans).to(device)
    x = torch.randn(batch, in_chans, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if compile_mode:
        model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast(amp, device):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler else loss).backward()
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--in-chans", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default=None, help="also time torch.compile(mode) with the fastest eager setting")
    args = parser.parse_args()
    device = torch.device(args.device)
    use_cudnn_autotuner(device)  # as training does
    precisions = ["off", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    print(f"{args.model}, batch {args.batch}, {device}, {torch.get_num_threads()} threads, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'size':>5} {'precision':>9} {'layout':>13} {'img/s':>8} {'vs fp32 NCHW':>13}")
    for size in args.sizes:
        reference = None
        for amp in precisions:
            for channels_last in (False, True):
                t = step_time(args.model, size, args.batch, amp, channels_last, device, args.steps, args.warmup,
                              args.in_chans)
                rate = args.batch / t
                reference = reference or rate
                layout = "channels_last" if channels_last else "NCHW"
                print(f"{size:>5} {('fp32' if amp == 'off' else amp):>9} {layout:>13} {rate:>8.0f} "
                      f"{rate / reference:>12.2f}x", flush=True)
        if args.compile:
            amp = "bf16"
            start = time.perf_counter()
            t = step_time(args.model, size, args.batch, amp, True, device, args.steps, args.warmup,
                          args.in_chans, args.compile)
            total = time.perf_counter() - start
            print(f"{size:>5} {amp:>9} {'cl+compile':>13} {args.batch / t:>8.0f} {args.batch / t / reference:>12.2f}x"
                  f"   (compile + all steps took {total:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
