"""The roofline: FLOP and byte counts against analytic ones, the time charged to ops, the table at its edges."""

import pytest
import torch

from cnnpipe.data.store.shards import open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.measure import build_setup
from cnnpipe.profile.peaks import MIN_N, count_batch, count_ops, count_step, matmul_gflops
from cnnpipe.profile.roofline import OpEvent, Peaks, attribute_self_time, headline, markdown, op_table, summarize
from cnnpipe.train.distributed import DistInfo
from conftest import tiny_params, write_params

pytestmark = pytest.mark.usefixtures("one_thread")

PEAKS = Peaks(bf16_gflops=1000.0, fp32_gflops=200.0, copy_gbs=50.0, bf16_n=2048, fp32_n=2048, copy_mib=256,
              seconds=3.0)


def test_flops_of_two_linear_layers_are_the_analytic_count_forward_and_backward():
    """Forward 2MKN + 2MNP; backward: both weight gradients (2MKN, 2MNP) and the second layer's input
    gradient (2MNP), not the first's (the input needs none): 4MKN + 6MNP in all."""
    m, k, n, p = 8, 16, 32, 4
    model = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.Linear(n, p))
    x = torch.randn(m, k)
    flops, _ = count_ops(lambda: model(x).sum().backward())
    assert sum(flops.values()) == 4 * m * k * n + 6 * m * n * p
    forward, _ = count_ops(lambda: model(x))
    assert sum(forward.values()) == 2 * m * k * n + 2 * m * n * p


def test_flops_of_a_convolution_are_the_analytic_count_and_grow_with_the_batch():
    """A 3x3 convolution without padding: 2 B O Ho Wo C k k forward, and the weight's gradient as much
    again; the count at batch 4 is twice batch 2's (what scaling a halved batch's count relies on)."""
    conv = torch.nn.Conv2d(3, 5, 3)

    def count(batch):
        x = torch.randn(batch, 3, 10, 10)
        return count_ops(lambda: conv(x).sum().backward())[0]

    forward = 2 * 2 * 5 * 8 * 8 * 3 * 3 * 3
    two = count(2)
    assert two["aten::convolution"] == forward and two["aten::convolution_backward"] == forward
    assert sum(count(4).values()) == 2 * sum(two.values())


def test_operand_bytes_count_each_tensor_once_and_views_not_at_all():
    """`x @ w.t()` reads x and w and writes the product: (MK + KN + MN) x 4 bytes under `aten::mm`;
    the transpose is a view and moves nothing; an in-place ReLU reads and writes one tensor."""
    m, k, n = 6, 10, 7
    x, w = torch.randn(m, k), torch.randn(n, k)
    _, bytes_ = count_ops(lambda: torch.relu_(x @ w.t()))
    assert bytes_["aten::mm"] == 4 * (m * k + k * n + m * n)
    assert bytes_["aten::relu_"] == 4 * m * n and "aten::t" not in bytes_


def test_a_slow_step_is_counted_at_a_halved_batch_never_under_two():
    assert count_batch(256, 0.01, None) == 256 and count_batch(256, 0.01, 10.0) == 256
    assert count_batch(256, 0.01, 1.0) == 64 and count_batch(256, 0.01, 0.0) == 2


def test_a_step_counted_at_a_halved_batch_has_the_full_batchs_flops_and_leaves_the_model_alone(tmp_path, prepared):
    """The profile's own model (batch 32, bf16 autocast, channels_last as the optimized recipe runs):
    counted at batch 16 and scaled, the FLOPs are the full batch's to the unit; the count runs on a
    copy, so the model's BatchNorm statistics and gradients are as they were."""
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(batch_size=32))), "optimized")
    s = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    before = {k: v.clone() for k, v in s.ctx.model.state_dict().items()}
    full = count_step(s, per_image_s=1.0, share_s=None)
    halved = count_step(s, per_image_s=1.0, share_s=16.0)  # a step of 32 images would take 32 s
    assert sum(full.flops.values()) > 0 and halved.flops == full.flops
    assert "at batch 32" in full.basis and "at batch 16, x 2 for batch 32" in halved.basis
    assert {"aten::convolution", "aten::convolution_backward"} <= full.ops
    assert all(torch.equal(v, s.ctx.model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in s.ctx.model.parameters())


def test_a_matmul_too_slow_for_its_share_is_measured_smaller():
    """No time at all: the size halves down to its floor, and the rate is still measured there."""
    gflops, n = matmul_gflops(torch.device("cpu"), torch.float32, 0.0)
    assert n == MIN_N and gflops > 0


STEP = "ProfilerStep#3"


def events():
    """One traced step: a convolution whose time sits in its oneDNN child, the optimizer's add_ (a name
    the counter also saw in the model), a region's glue, and an op after the step (dropped)."""
    return [OpEvent(STEP, None, 5.0, annotation=True),                 # 0
            OpEvent("forward", 0, 10.0, annotation=True),              # 1
            OpEvent("aten::convolution", 1, 2.0),                      # 2
            OpEvent("aten::mkldnn_convolution", 2, 600.0),             # 3
            OpEvent("aten::add_", 1, 30.0),                            # 4
            OpEvent("optimizer", 0, 1.0, annotation=True),             # 5
            OpEvent("Optimizer.step#SGD.step", 5, 4.0, annotation=True),  # 6
            OpEvent("aten::add_", 6, 300.0),                           # 7
            OpEvent("aten::relu", None, 1000.0)]                       # 8: outside every step


def test_self_time_goes_to_the_counted_op_above_it_or_to_its_region():
    time_us = attribute_self_time(events(), {"aten::convolution", "aten::add_"})
    assert time_us == {"[step]": 5.0, "[forward]": 10.0, "aten::convolution": 602.0, "aten::add_": 30.0,
                       "[optimizer]": 305.0}
    # with nothing counted every op is its region's; nothing outside a step counts either way
    assert attribute_self_time(events(), set()) == {"[step]": 5.0, "[forward]": 642.0, "[optimizer]": 305.0}
    assert attribute_self_time([], {"aten::mm"}) == {}


def test_the_op_table_at_its_edges():
    """No time: no rows; an op the counter did not see: no rates; past `top`, one row of the rest,
    and the shares add up to 1."""
    flops = {"aten::convolution": 4e9}
    assert op_table({}, flops, {}, 1.0, 100.0, 10.0) == []
    assert op_table({"aten::convolution": 0.0}, flops, {}, 1.0, 100.0, 10.0) == []
    assert op_table({"aten::convolution": 5.0}, flops, {}, 0.0, 100.0, 10.0) == []
    time_us = {"aten::convolution": 500.0, "[optimizer]": 300.0, "aten::add_": 150.0, "[step]": 50.0}
    rows = op_table(time_us, flops, {"aten::add_": 3e8}, 2.0, 100.0, 10.0, top=3)
    conv, optimizer, add, rest = rows
    assert conv["op"] == "aten::convolution" and conv["time_share"] == 0.5
    assert conv["gflops"] == pytest.approx(4.0) and conv["peak_frac"] == pytest.approx(0.04)  # 4 GFLOP in 1 s
    assert optimizer["gflops"] is None and optimizer["gbs"] is None and optimizer["peak_frac"] is None
    assert add["gbs"] == pytest.approx(1.0) and add["bandwidth_frac"] == pytest.approx(0.1)  # 0.3 GB in 0.3 s
    assert rest["op"] == "[1 other ops]" and sum(r["time_share"] for r in rows) == pytest.approx(1.0)


def test_the_step_share_and_its_rendering():
    """130 GFLOP in a second of a 1,000 GFLOP/s bf16 machine: 13%, as the headline says; an fp32
    recipe is also set against the fp32 rate; a step without time has no rate and says so."""
    time_us = {"aten::convolution": 700.0, "[optimizer]": 300.0}
    r = summarize(PEAKS, "bf16", 1.0, {"aten::convolution": 130e9}, {"aten::convolution": 5e9}, time_us, "counted")
    assert r["achieved_gflops"] == pytest.approx(130.0) and r["bf16_share"] == pytest.approx(0.13)
    assert r["math_share"] == r["bf16_share"] and r["bandwidth_share"] == pytest.approx(0.1)
    text = headline(r)
    assert text.startswith("the step runs at 13% of this machine's bf16 rate (130 GFLOP/s of 1,000)")
    assert "aten::convolution 70%" in text and "[optimizer] 30%" in text
    table = markdown(r)
    assert "| `aten::convolution` | 70% | 186 | 19% | 7.1 | 14% |" in table  # 130 GFLOP in 0.7 s
    # on CUDA the shares are of the kernels' 0.5 s a step: the convolution ran in 0.35 s, not 0.7
    kernels = summarize(PEAKS, "bf16", 1.0, {"aten::convolution": 130e9}, {}, time_us, "counted", op_step_s=0.5)
    assert kernels["ops"][0]["gflops"] == pytest.approx(2 * r["ops"][0]["gflops"])
    assert kernels["achieved_gflops"] == r["achieved_gflops"]  # the step's rate stays the step's
    fp32 = summarize(PEAKS, "off", 1.0, {"aten::mm": 20e9}, {}, {}, "counted")
    assert fp32["math_share"] == pytest.approx(0.1) and "10% of its fp32 rate" in headline(fp32)
    assert r["limit"] == "bf16" and r["limit_share"] == r["bf16_share"]
    # a CPU whose fp32 matmul outruns its bf16 one (AVX512-BF16 without AMX): the limit is fp32's rate
    slow_bf16 = Peaks(**{**PEAKS.to_dict(), "bf16_gflops": 181.0, "fp32_gflops": 290.0})
    no_amx = summarize(slow_bf16, "bf16", 1.0, {"aten::convolution": 95e9}, {}, time_us, "counted")
    assert no_amx["limit"] == "fp32" and no_amx["limit_share"] == pytest.approx(95 / 290)
    assert headline(no_amx).startswith("the step runs at 33% of this machine's fp32 rate, its faster matmul here "
                                       "(95 GFLOP/s of 290; bf16 181)")
    idle = summarize(PEAKS, "bf16", 0.0, {"aten::mm": 20e9}, {}, {}, "counted")
    assert idle["achieved_gflops"] is None and idle["ops"] == [] and "cannot be set against" in headline(idle)
