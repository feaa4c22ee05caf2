"""How far a training step runs from what this machine can do: a roofline from measured peaks.

The profile measures the machine's own peaks (`profile/peaks.py`: a bf16 and an fp32 matrix product
and a memory copy), counts one step's FLOPs and bytes per op (`peaks.count_step`), and reads each
op's time from the trace. This module turns those numbers into the report's figures and is pure
(no torch), so the report stage can render them from the JSON alone:

- the whole step: achieved GFLOP/s (FLOPs per step over the un-profiled median step time) as a share
  of the bf16 peak, of the peak of the dtype the recipe computes in, and of the machine's limit (the
  faster of the two: `limit`);
- the ops that spend the step's time: each op's share of the traced steps' time, charged to the op
  the counter saw (`attribute_self_time`), and from it the op's GFLOP/s (matrix ops) or GB/s (every
  counted op) against the peaks. An op's seconds are its share times the *un-profiled* step time:
  the profiler stretches small ops more than large ones, but the shares stay close, and the headline
  and the table then add up to the same step. On CUDA the shares are of kernel time and an op's
  seconds its share of the kernels' time per step (the GPU idles between kernels).

The peaks are a plain matrix product and a plain copy, not a vendor's datasheet: "N% of the bf16
rate" means N% of what `torch.matmul` reaches on this machine in this process, at its thread count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

TOP_OPS = 8
"""Rows in the op table; the rest are summed into one row."""
STEP_MARK = "ProfilerStep"
"""torch.profiler's per-step annotation (`ProfilerStep#N`): time outside these spans is not a step's."""
COUNTED_REGIONS = ("forward", "backward")
"""The regions whose ops the FLOP/byte count ran (one forward and backward of the model); ops of
the same name elsewhere (the optimizer's `add_`, the augmentation's `copy_`) are charged to their region."""


@dataclass(frozen=True)
class Peaks:
    """This machine's measured peaks, in the process and thread count the profile trains with."""

    bf16_gflops: float
    fp32_gflops: float
    copy_gbs: float
    """Bytes read plus bytes written per second by a large tensor copy (`dst.copy_(src)`)."""
    bf16_n: int
    """The bf16 matrix products' size (n x n by n x n: 2 n^3 FLOPs each); smaller where a slow one
    would not fit its share of the box."""
    fp32_n: int
    copy_mib: int
    seconds: float
    """What measuring the three took, warm-up included (inside the profile's time box)."""

    def gflops(self, math: str) -> float:
        """The peak for a recipe's `amp` (`off`: fp32; `bf16` and `fp16`: the bf16 rate, which fp16
        shares on the GPUs that run either fast)."""
        return self.fp32_gflops if math == "off" else self.bf16_gflops

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def limit(peaks: dict[str, Any]) -> tuple[str, float | None]:
    """This machine's limit from a profile's measured `peaks` (its JSON): the faster matmul, bf16's
    unless fp32 ran faster (a CPU with AVX512-BF16 but no AMX ran bf16 at 181 GFLOP/s against fp32's
    290); (`bf16`, None) where the peaks are missing."""
    bf16, fp32 = peaks.get("bf16_gflops"), peaks.get("fp32_gflops")
    if bf16 and fp32 and fp32 > bf16:
        return "fp32", fp32
    return "bf16", bf16


@dataclass(frozen=True)
class OpEvent:
    """One event of a trace: its name, its parent's index in the same list, its self time (µs), and
    whether it is an annotation (a region label or a `ProfilerStep#` mark) rather than an op."""

    name: str
    parent: int | None
    self_us: float
    annotation: bool = False


def attribute_self_time(events: list[OpEvent], counted: Iterable[str]) -> dict[str, float]:
    """Self time (µs) per op, every event's own time charged once, summed over the recorded steps.

    Inside a forward or backward region, an event's self time goes to the outermost op above it
    (itself included) that the counter saw (`counted`): the counter sees `aten::convolution`, the
    trace shows its time in `aten::mkldnn_convolution` below it. Anything else goes to its region in
    brackets (`[optimizer]`, `[forward]` for a region's glue between ops), or `[step]` for a
    step's time outside every region. Events outside any `ProfilerStep#` span are dropped.
    """
    counted = set(counted)
    out: dict[str, float] = {}
    for event in events:
        if event.self_us <= 0:
            continue
        op, region, in_step = None, None, False
        node: OpEvent | None = event
        while node is not None:  # up to the root: the outermost region and counted op win
            if node.annotation and node.name.startswith(STEP_MARK):
                in_step = True
            elif node.annotation:
                region = node.name
            elif node.name in counted:
                op = node.name
            node = events[node.parent] if node.parent is not None else None
        if not in_step:
            continue
        key = op if op is not None and region in COUNTED_REGIONS else f"[{region or 'step'}]"
        out[key] = out.get(key, 0.0) + event.self_us
    return out


def rate(amount: float | None, seconds: float) -> float | None:
    """`amount` per second, or None when there is no amount or no time to divide by."""
    if not amount or seconds <= 0:
        return None
    return amount / seconds


def share(value: float | None, peak: float) -> float | None:
    """`value` as a fraction of `peak` (None when either is missing)."""
    if value is None or peak <= 0:
        return None
    return value / peak


def op_table(time_us: dict[str, float], flops: dict[str, float], bytes_: dict[str, float], step_s: float,
             peak_gflops: float, copy_gbs: float, top: int = TOP_OPS) -> list[dict[str, Any]]:
    """The ops that spend the step, most time first: each one's share of the traced time, and from its
    seconds in an un-profiled step (`share x step_s`) its GFLOP/s and GB/s against the peaks. Ops the
    counter did not see (a region's other ops) have no rates; past `top`, the rest are one row."""
    total = sum(time_us.values())
    if total <= 0 or step_s <= 0:
        return []
    ordered = sorted(time_us.items(), key=lambda kv: (-kv[1], kv[0]))
    rows = []
    for name, us in ordered[:top]:
        seconds = us / total * step_s
        gflops = rate(flops.get(name), seconds * 1e9)
        gbs = rate(bytes_.get(name), seconds * 1e9)
        rows.append({"op": name, "time_share": us / total, "gflops": gflops, "peak_frac": share(gflops, peak_gflops),
                     "gbs": gbs, "bandwidth_frac": share(gbs, copy_gbs)})
    rest = ordered[top:]
    if rest:
        rows.append({"op": f"[{len(rest)} other ops]", "time_share": sum(us for _, us in rest) / total,
                     "gflops": None, "peak_frac": None, "gbs": None, "bandwidth_frac": None})
    return rows


def summarize(peaks: Peaks, amp: str, step_s: float, flops: dict[str, float], bytes_: dict[str, float],
              time_us: dict[str, float], basis: str, op_step_s: float | None = None) -> dict[str, Any]:
    """The profile JSON's `roofline` section. `flops` and `bytes_` are per op for one optimizer step
    (as `peaks.count_step` counts them), `time_us` per op over the traced steps (`attribute_self_time`),
    `step_s` the un-profiled median step; `basis` says how the counts were taken. `op_step_s`: the
    seconds the ops' time shares are of (default `step_s`; on CUDA the kernels' time per step)."""
    step_flop, step_bytes = sum(flops.values()), sum(bytes_.values())
    achieved = rate(step_flop, step_s * 1e9)
    achieved_gbs = rate(step_bytes, step_s * 1e9)
    peak = peaks.gflops(amp)
    limit_math, limit_gflops = limit(peaks.to_dict())
    return {"peaks": peaks.to_dict(), "math": "fp32" if amp == "off" else "bf16",
            "step_gflop": step_flop / 1e9, "step_gb": step_bytes / 1e9,
            "achieved_gflops": achieved, "bf16_share": share(achieved, peaks.bf16_gflops),
            "math_share": share(achieved, peak), "limit": limit_math, "limit_share": share(achieved, limit_gflops),
            "achieved_gbs": achieved_gbs,
            "bandwidth_share": share(achieved_gbs, peaks.copy_gbs),
            "ops": op_table(time_us, flops, bytes_, step_s if op_step_s is None else op_step_s, peak, peaks.copy_gbs),
            "basis": basis}


def _pct(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1%}" if value < 0.1 else f"{value:.0%}"


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def headline(r: dict[str, Any]) -> str:
    """One sentence: how far the step is from this machine's limit (the bf16 rate, or the fp32 one
    where that ran faster), and which ops spend the rest."""
    peaks = r["peaks"]
    if r["achieved_gflops"] is None:
        return "the step cannot be set against the peaks: no FLOPs were counted, or no step time measured"
    if r["limit"] == "fp32":
        text = (f"the step runs at {_pct(r['limit_share'])} of this machine's fp32 rate, "
                f"its faster matmul here ({_num(r['achieved_gflops'])} GFLOP/s of {_num(peaks['fp32_gflops'])}; "
                f"bf16 {_num(peaks['bf16_gflops'])})")
    else:
        text = (f"the step runs at {_pct(r['bf16_share'])} of this machine's bf16 rate "
                f"({_num(r['achieved_gflops'])} GFLOP/s of {_num(peaks['bf16_gflops'])})")
        if r["math"] == "fp32":
            text += f", {_pct(r['math_share'])} of its fp32 rate ({_num(peaks['fp32_gflops'])}), the math it trains in"
    ops = [row for row in r["ops"] if not row["op"].endswith("other ops]")][:3]
    if ops:
        text += "; these ops spend the time: " + ", ".join(
            f"{row['op']} {_pct(row['time_share'])}" + (f" at {_pct(row['peak_frac'])} of peak" if row["peak_frac"]
                                                       else "") for row in ops)
    return text


def markdown(r: dict[str, Any]) -> list[str]:
    """The report's roofline paragraph and op table (from the JSON's `roofline` section alone)."""
    p = r["peaks"]
    lines = [f"**Roofline:** {headline(r)}.", "",
             f"Peaks measured in this profile ({p['seconds']:.1f} s, outside the timed steps): bf16 "
             f"{_num(p['bf16_gflops'])} GFLOP/s and fp32 {_num(p['fp32_gflops'])} GFLOP/s "
             f"(`torch.matmul` of {p['bf16_n']} and {p['fp32_n']} square), copy {_num(p['copy_gbs'])} GB/s "
             f"({p['copy_mib']} MiB, read + write). A step: {r['step_gflop']:.2f} GFLOP and "
             f"{r['step_gb']:.2f} GB of operands ({r['basis']}).", ""]
    if not r["ops"]:
        return lines
    lines += [f"| Op (time of the traced steps) | Time share | GFLOP/s | % of {r['math']} peak | GB/s | % of copy |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["ops"]:
        lines.append(f"| `{row['op']}` | {_pct(row['time_share'])} | {_num(row['gflops'])} | "
                     f"{_pct(row['peak_frac'])} | {_num(row['gbs'])} | {_pct(row['bandwidth_frac'])} |")
    return lines
