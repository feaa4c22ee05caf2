"""Benchmark: the optimized recipe's step with its small-map convolutions in fp32, against all-bf16.

On a Zen 4 without AMX, oneDNN's bf16 weight gradient of the late 3x3 convolutions (1x1 and 2x2
maps at 32 px) runs 2-3.5x slower than the same gradient in fp32 (docs/benchmarks.md). This times
whether taking those convolutions out of autocast pays back in a whole step: ResNet-50 (timm), bf16
autocast, channels_last, SGD with Nesterov momentum, random images, batch and size as given. Each
setting is a model whose convolutions with an output map of at most `--max-pixels` pixels run in
fp32 (`small`: all of them; `small3x3`: only the 3x3 ones), the rest under bf16 autocast; blocks of
steps alternate between the settings (ABBA), and each prints its median images/s and its ratio to
all-bf16.

    python bench/late_fp32.py                      # 32 px, batch 256, maps of 1 pixel (layer4)
    python bench/late_fp32.py --max-pixels 4       # and layer3's 2x2 maps
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import timm
import torch
import torch.nn.functional as F


def fp32_forward(self: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The convolution outside autocast, in fp32 (its input cast up)."""
    with torch.autocast(x.device.type, enabled=False):
        return self._conv_forward(x.float(), self.weight, self.bias)


def output_pixels(model: torch.nn.Module, size: int) -> dict[str, int]:
    """Each convolution's output map size (pixels) at `size` px."""
    seen: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out.shape[-2] * out.shape[-1]))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(torch.zeros(2, 3, size, size).to(memory_format=torch.channels_last))
    for hook in hooks:
        hook.remove()
    return seen


def build(setting: str, size: int, max_pixels: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """(model, optimizer, how many convolutions run in fp32) for one setting."""
    torch.manual_seed(0)
    model = timm.create_model("resnet50", num_classes=10).to(memory_format=torch.channels_last)
    picked = [] if setting == "bf16" else [n for n, px in output_pixels(model, size).items() if px <= max_pixels]
    if setting == "small3x3":
        picked = [n for n in picked if model.get_submodule(n).kernel_size == (3, 3)]
    for name in picked:
        conv = model.get_submodule(name)
        conv.forward = types.MethodType(fp32_forward, conv)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    return model, optimizer, len(picked)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-pixels", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    args = parser.parse_args()
    x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,))
    settings = {s: build(s, args.size, args.max_pixels) for s in ("bf16", "small", "small3x3")}
    times: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings if r % 2 == 0 else list(settings)[::-1]:
            model, optimizer, _ = settings[s]
            step(model, optimizer, x, y)  # re-warms caches after the switch
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(model, optimizer, x, y)
                times[s].append(time.perf_counter() - t0)
    base = statistics.median(times["bf16"])
    print(f"ResNet-50, {args.size} px, batch {args.batch}, {torch.get_num_threads()} threads, convolutions with "
          f"outputs of at most {args.max_pixels} pixel(s) in fp32:")
    for s, (_, _, n) in settings.items():
        med = statistics.median(times[s])
        print(f"  {s:9} ({n:2d} convolutions fp32): {args.batch / med:6.1f} img/s, {base / med:.2f}x all-bf16")


if __name__ == "__main__":
    main()
