"""Bottleneck rules at their edges."""

import pytest

from cnnpipe.profile.diagnosis import (
    BUSY_FRAC,
    COMM_FRAC,
    INPUT_WAIT_FRAC,
    KERNEL_FRAC,
    PAGE,
    MEMORY_FRAC,
    SYNC_COUNT,
    SYNC_FRAC,
    TENSOR_CORE_FRAC,
    Facts,
    diagnose,
)
from cnnpipe.profile.kernels import busy_fraction, is_matrix_kernel, is_tensor_core_kernel, tensor_core_share

COMPUTE = {"data_wait": 0.0, "copy": 0.0, "augment": 0.0, "forward": 0.3, "backward": 0.6, "optimizer": 0.1,
           "sync": 0.0}


def facts(**kw):
    fr = dict(COMPUTE)
    fr.update(kw.pop("fractions", {}))
    return Facts(fractions=fr, amp=kw.pop("amp", "bf16"), channels_last=kw.pop("channels_last", True), **kw)


@pytest.mark.parametrize("region, threshold, label", [
    ("data_wait", INPUT_WAIT_FRAC, "input"),
    ("communication", COMM_FRAC, "communication"),
    ("sync", SYNC_FRAC, "host_sync"),
])
def test_fraction_rules_fire_just_above_their_threshold(region, threshold, label):
    assert diagnose(facts(fractions={region: threshold}))[0] == "compute"
    fired, recs = diagnose(facts(fractions={region: threshold + 0.001}))
    assert fired == label
    assert recs[0].evidence[f"{region}_frac"] == pytest.approx(threshold + 0.001, abs=1e-4)


def test_input_advice_depends_on_the_loader():
    _, recs = diagnose(facts(fractions={"data_wait": 0.3}, loader="baseline"))
    assert "fast batched loader" in recs[0].action
    _, recs = diagnose(facts(fractions={"data_wait": 0.3}, loader="fast", num_workers=0))
    assert "num_workers" in recs[0].action
    assert "1.43x" in recs[0].expected_gain


def test_memory_rule():
    assert diagnose(facts(memory_frac=MEMORY_FRAC))[0] == "compute"
    label, recs = diagnose(facts(memory_frac=0.95, amp="off"))
    assert label == "memory" and "AMP" in recs[0].action


def test_small_batch_from_utilisation_or_measured_gain():
    assert diagnose(facts(utilization=0.5))[0] == "compute"
    assert diagnose(facts(utilization=0.49))[0] == "small_batch"
    assert diagnose(facts(batch_gain=1.15))[0] == "compute"
    label, recs = diagnose(facts(batch_gain=1.3, batch_size=8))
    assert label == "small_batch" and "1.30x" in recs[0].expected_gain and "batch 16" in recs[0].expected_gain
    _, recs = diagnose(facts(batch_gain=1.3, batch_size=8, best_batch=32))
    assert recs[0].evidence["throughput_gain_at_batch_32"] == 1.3 and "best 32" in recs[0].action


def test_compute_advice_amp_and_layout():
    label, recs = diagnose(facts(amp="off", channels_last=False))
    assert label == "compute"
    actions = " ".join(r.action for r in recs)
    assert "mixed precision" in actions and "channels_last" in actions
    assert diagnose(facts())[1] == []


def test_page_faults_ask_for_the_kept_allocator_just_above_their_threshold():
    assert diagnose(facts(kernel_frac=KERNEL_FRAC, page_faults_per_step=1e6))[0] == "compute"
    label, recs = diagnose(facts(kernel_frac=0.25, page_faults_per_step=1.2e6))
    assert label == "page_faults" and recs[0].knob == "malloc" and "train.malloc: keep" in recs[0].action
    assert recs[0].evidence == {"kernel_frac": 0.25, "threshold": KERNEL_FRAC, "page_faults_per_step": 1200000}
    assert f"{1.2e6 * PAGE / 1e9:.2f} GB of pages a step" in recs[0].action and "1.33x" in recs[0].expected_gain
    assert diagnose(facts(kernel_frac=0.25, malloc="keep"))[0] == "compute"  # already kept: the kernel's own
    assert diagnose(facts(kernel_frac=0.25, device="cuda"))[0] == "compute"  # the driver's, mostly
    assert diagnose(facts(kernel_frac=0.25, fractions={"data_wait": 0.3}))[0] == "input"


def test_input_outranks_everything_else():
    label, recs = diagnose(facts(fractions={"data_wait": 0.4, "sync": 0.2}, memory_frac=0.99, utilization=0.1))
    assert label == "input" and [r.bottleneck for r in recs][:4] == ["input", "host_sync", "memory", "small_batch"]


def test_host_sync_count_names_the_bottleneck_on_cuda_only():
    assert diagnose(facts(device="cuda", host_syncs_per_step=SYNC_COUNT - 0.1))[0] == "compute"
    label, recs = diagnose(facts(device="cuda", host_syncs_per_step=SYNC_COUNT, utilization=BUSY_FRAC - 0.01))
    assert label == "host_sync" and recs[0].evidence == {"host_syncs_per_step": SYNC_COUNT, "threshold": SYNC_COUNT,
                                                         "gpu_busy_frac": BUSY_FRAC - 0.01}
    # A GPU that stays busy despite the sync is not waiting on the host.
    assert diagnose(facts(device="cuda", host_syncs_per_step=4, utilization=BUSY_FRAC))[0] == "compute"
    # On the CPU a sync drains nothing: only measured sync time may blame it.
    assert diagnose(facts(device="cpu", host_syncs_per_step=100))[0] == "compute"


def test_matrix_work_off_tensor_cores_asks_for_amp_even_when_amp_is_on():
    _, recs = diagnose(facts(device="cuda", amp="bf16", tensor_core_frac=TENSOR_CORE_FRAC - 0.01))
    assert [r.knob for r in recs] == ["amp"] and recs[0].evidence["tensor_core_frac"] == pytest.approx(0.49)
    _, recs = diagnose(facts(device="cuda", amp="bf16", tensor_core_frac=TENSOR_CORE_FRAC))
    assert recs == []


@pytest.mark.parametrize("name, matrix, tensor_core", [
    ("volta_sgemm_128x64_nn", True, False),
    ("ampere_sgemm_64x32_sliced1x4_nn", True, False),
    ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5>", True, False),
    ("volta_h884gemm_64x64_ldg8_nn", True, True),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nn", True, True),
    ("sm80_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", True, True),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1", True, True),
    ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", True, True),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float>>", False, False),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>", False, False),
])
def test_kernel_names_tell_tensor_core_work(name, matrix, tensor_core):
    assert is_matrix_kernel(name) == matrix
    assert is_tensor_core_kernel(name) == tensor_core


def test_tensor_core_share_and_busy_fraction():
    kernels = [("volta_sgemm_128x64_nn", 30.0), ("ampere_bf16_s16816gemm_bf16", 90.0), ("elementwise_kernel", 80.0)]
    assert tensor_core_share(kernels) == pytest.approx(0.75)
    assert tensor_core_share([("elementwise_kernel", 5.0)]) is None
    assert busy_fraction(kernels, wall_us=400.0) == pytest.approx(0.5)
    assert busy_fraction(kernels, wall_us=100.0) == 1.0 and busy_fraction([], 100.0) is None
