"""The profiler: scenarios with a known bottleneck, the trace, and the real TensorBoard plugin."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, Dataset

from cnnpipe.data.loaders.host import TrainLoader
from cnnpipe.data.loaders.sampling import ShardSampler
from cnnpipe.data.store.shards import PreparedSplit, open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.clock import OUT_OF_TIME, TrialClock
from cnnpipe.profile.decision import confirm_winners, tuned_settings, tuned_speedup
from cnnpipe.profile.diagnosis import Facts, diagnose
from cnnpipe.profile.measure import Feed, build_setup, count_inside, fractions, timed_steps, trace_window
from cnnpipe.profile.report import to_markdown, write_report
from cnnpipe.profile.run import profile_variant, summary
from cnnpipe.profile.box import TraceSteps
from cnnpipe.profile.trials import Trial, TrialContext, candidates, compile_trial, paired_trial
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.tuning import resolve_auto
from conftest import tiny_params, write_params


def config(tmp_path, variant="optimized", model=None, **train):
    params = tiny_params(**train)
    if model:
        params["model"]["name"] = model
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), variant)


pytestmark = pytest.mark.usefixtures("one_thread")


RAW_SPLIT = PreparedSplit(np.zeros((40, 8, 8, 1), np.uint8), np.zeros(40, np.int64), ["a"])
"""A raw store's split in memory, for the trials whose setups a test fakes."""


def trial_ctx(cfg, base=None, requested=None, clock=None):
    """The trials' context for `cfg` against `base`, reading its split (a raw one where the test fakes
    the base); no time limit unless `clock` says otherwise."""
    return TrialContext(cfg, requested or cfg, DistInfo(), getattr(base, "split", RAW_SPLIT), base,
                        clock or TrialClock.unlimited(cfg.profile.trial_steps))


TRACE = TraceSteps(0, 1, 2)


def label_of(cfg, prepared, setup_hook=None, batch_gain=None):
    """The label for the measured step-time shares, the other facts fixed (utilization: a busy CPU;
    a measured one would depend on what else the machine runs)."""
    s = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    if setup_hook:
        setup_hook(s)
    _, totals, _, _ = timed_steps(s, warmup=1, steps=3)
    t = s.cfg.train
    facts = Facts(fractions=fractions(totals), amp=s.ctx.amp, channels_last=t.channels_last, loader=t.loader,
                  batch_size=t.batch_size, utilization=1.0, batch_gain=batch_gain)
    return diagnose(facts)[0], fractions(totals)


class SleepyDataset(Dataset):
    """A data set that takes 20 ms per sample: the classic input-bound pipeline."""

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.zeros(28, 28, 1, dtype=torch.uint8), 0


def test_sleeping_dataset_is_input_bound(tmp_path, prepared):
    def slow_loader(s):
        sampler = ShardSampler(10_000, 16, shuffle=False, drop_last=True)
        s.loader = TrainLoader(DataLoader(SleepyDataset(), batch_size=16), sampler, s.loader.device_transform)
        s.feed = Feed(s.loader)

    label, fr = label_of(config(tmp_path, batch_size=16), prepared, slow_loader)
    assert label == "input" and fr["data_wait"] > 0.5


def test_fast_loader_fp32_model_is_compute_bound(tmp_path, prepared):
    label, fr = label_of(config(tmp_path, model="resnet18", amp="off", batch_size=32), prepared)
    assert label == "compute"
    assert fr["forward"] + fr["backward"] + fr["optimizer"] > 0.8


def test_a_batch_trial_measures_both_sides_and_its_gain_names_small_batch(tmp_path, prepared):
    """The trial's verdict follows from its own numbers (how fast the doubling is depends on the
    machine); a measured gain of 1.3x on a compute-bound step is the small_batch label, 1.1x is not."""
    cfg = config(tmp_path, model="resnet18", batch_size=2)
    current = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    bigger = build_setup(config(tmp_path, model="resnet18", batch_size=4), DistInfo(), open_split(prepared, "train"))
    trial = paired_trial("batch_size", {"batch_size": 4}, current, bigger, rounds=3, steps=2, min_gain=0.05)
    low, high = trial.speedup_range
    assert trial.before_img_s > 0 and trial.after_img_s > 0 and low <= trial.speedup <= high
    assert trial.win == (trial.speedup >= 1.05 and low > 1.0)
    assert label_of(cfg, prepared, batch_gain=1.3)[0] == "small_batch"
    assert label_of(cfg, prepared, batch_gain=1.1)[0] == "compute"


class ItemEveryStep(torch.nn.Module):
    """A model whose forward reads a scalar back to Python on every step (a host sync on CUDA)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        if out.abs().max().item() > 1e6:  # data-dependent Python control flow: the classic hidden sync
            out = out / 2
        return out


def test_item_every_step_is_counted_but_is_no_bottleneck_on_the_cpu(tmp_path, prepared):
    """On the CPU ops run synchronously, so the extra `.item()` costs ~1 us and drains nothing:
    the profile counts it (and would name host_sync on CUDA) but does not blame it for time here."""
    cfg = config(tmp_path, amp="off")
    train = open_split(prepared, "train")
    plain = trace_window(build_setup(cfg, DistInfo(), train), tmp_path / "a", "plain", TRACE, 0.1)
    s = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    s.ctx.model = ItemEveryStep(s.ctx.model)
    synced = trace_window(s, tmp_path / "b", "synced", TRACE, 0.1)
    assert synced["host_syncs_per_step"] == plain["host_syncs_per_step"] + 1
    label, fr = label_of(cfg, prepared, lambda x: setattr(x.ctx, "model", ItemEveryStep(x.ctx.model)))
    assert label == "compute" and fr["sync"] < 0.05
    # On CUDA the trainer's own NaN guard reads the loss only every 50 steps; the model's read remains.
    model_syncs = synced["host_syncs_per_step"] - plain["host_syncs_per_step"]
    facts = Facts(fractions=fr, device="cuda", amp="bf16", channels_last=True, host_syncs_per_step=model_syncs)
    assert diagnose(facts)[0] == "host_sync"  # the same step on a GPU, where each sync stalls the queue


def test_the_trace_reads_its_steps_from_their_own_spans_not_the_window_wall(tmp_path, prepared):
    """The trace handler runs inside the last `prof.step()` (it writes the JSON): a handler that
    sleeps must change neither the profiled step time nor the syncs per step, which come from
    the `ProfilerStep#` spans (the GPU busy share divides kernel time by the un-profiled step).
    Counted in the last of the two traced steps, the sleep alone would put their median at half of
    it or more; a tiny model's step stays under that however loaded the machine, short of a hang."""
    cfg = config(tmp_path, amp="off")
    s = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    quick = trace_window(s, tmp_path / "a", "quick", TRACE, 0.1, on_trace_ready=lambda prof: None)
    handler_s = 2.0
    slow = trace_window(s, tmp_path / "b", "slow", TRACE, 0.1, on_trace_ready=lambda prof: time.sleep(handler_s))
    assert TRACE.active == 2 and slow["host_syncs_per_step"] == quick["host_syncs_per_step"]
    assert 0 < slow["trace_step_s"] < handler_s / 2 and 0 < quick["trace_step_s"] < handler_s / 2
    assert slow["gpu_busy_frac"] is None and slow["gpu_busy_basis"] is None  # (no kernels on the CPU)


def test_sync_events_are_matched_to_step_spans_by_bisection_as_by_brute_force():
    """`count_inside`, what the trace counts host syncs with: the same count as checking every event
    against every span, on spans that touch, overlap, nest or come unsorted, and events on their ends."""
    import random

    assert count_inside([], []) == 0 and count_inside([1.0], []) == 0
    assert count_inside([0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.1], [(2.0, 3.0), (1.0, 2.0)]) == 5  # ends count
    rng = random.Random(0)
    for _ in range(200):
        spans = [(a, a + rng.uniform(0, 20)) for a in (rng.uniform(0, 100) for _ in range(rng.randint(0, 12)))]
        times = [rng.choice([rng.uniform(-5, 125), *(x for span in spans for x in span)] if spans else [1.0])
                 for _ in range(50)]
        assert count_inside(times, spans) == sum(any(a <= t <= b for a, b in spans) for t in times)


def test_profile_variant_writes_a_trace_and_a_complete_breakdown(tmp_path, prepared):
    result = profile_variant(config(tmp_path), DistInfo(), prepared, tmp_path / "logs" / "optimized", True)
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    assert result["inference_img_s"] > 0 and result["throughput_img_s"] > 0
    # what a train stage pays beyond its steady steps, for the plan: a checkpoint write (its probe file
    # gone after) and the first step's warm-up
    assert result["checkpoint_s"] > 0 and result["warmup_s"] >= 0
    assert not list((tmp_path / "logs" / "optimized").glob(".checkpoint_probe*"))
    traces = list((tmp_path / "logs" / "optimized").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].name.startswith("optimized_rank0")
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "data_wait"} <= names
    assert any(n and n.startswith("ProfilerStep#") for n in names)
    assert {t["knob"] for t in result["trials"]} == {"amp", "channels_last", "batch_size", "loader", "num_workers",
                                                      "malloc"}
    assert {"knob": "malloc", "change": {"malloc": "keep"}}.items() <= next(
        t for t in result["trials"] if t["knob"] == "malloc").items()  # `auto` profiles glibc's defaults, tries keep
    # the base's steps as the kernel saw them: the page faults and its share of the CPU time
    assert result["malloc"] == "system" and result["page_faults_per_step"] >= 0 and 0 <= result["kernel_frac"] < 1
    for trial in result["trials"]:
        low, high = trial["speedup_range"]
        assert low <= trial["speedup"] <= high and trial["before_img_s"] > 0 and trial["after_img_s"] > 0
        paired_rule = trial["speedup"] >= 1 + result["min_gain"] and low > 1.0
        # a second doubling of the batch must also add min_gain over the first (batch_trials)
        second_doubling = trial["knob"] == "batch_size" and "more than batch" in trial["note"]
        assert trial["win"] == (paired_rule and not second_doubling), trial
    assert set(result["tuned"]) == {"amp", "channels_last", "loader", "num_workers", "decode", "malloc"}  # `auto`
    roofline = result["roofline"]  # the machine's peaks, and the step set against them
    assert min(roofline["peaks"][k] for k in ("bf16_gflops", "fp32_gflops", "copy_gbs")) > 0
    assert 0 < roofline["math_share"] <= 1 and roofline["step_gflop"] > 0
    assert "aten::convolution" in {row["op"] for row in roofline["ops"]}
    assert sum(row["time_share"] for row in roofline["ops"]) == pytest.approx(1.0)
    assert "roofline: the step runs at" in summary(result)
    tensorboard = EventAccumulator(str(tmp_path / "logs" / "optimized"), size_guidance={"tensors": 0}).Reload()
    assert "roofline/text_summary" in tensorboard.Tags()["tensors"]
    assert "roofline/achieved_gflops" in tensorboard.Tags()["scalars"]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "optimized.json").write_text(json.dumps(result))
    report = write_report(tmp_path / "m", ["optimized"]).read_text()
    assert "bottleneck" in report and (tmp_path / "m" / "breakdown.png").stat().st_size > 1000
    assert "| **step (median ± IQR)** |" in report and "Wins" in report
    assert "**Roofline:** the step runs at" in report and "| `aten::convolution` |" in report
    assert ("No rule fired" in report) == (not result["recommendations"])
    assert "malloc=system: " in report and " page faults a step, " in report
    assert "of the CPU time in the kernel" in report
    quiet = to_markdown({"optimized": {**result, "recommendations": []}}, "breakdown.png")
    assert "No rule fired: forward + backward + optimizer are" in quiet
    # A CPU whose fp32 matmul outruns its bf16 one (no AMX): the report sets the step against fp32's rate.
    roof = result["roofline"]
    fast_fp32 = {**roof, "achieved_gflops": 95.0, "limit": "fp32", "limit_share": 95.0 / 290.0,  # (as summarize says)
                 "peaks": {**roof["peaks"], "bf16_gflops": 181.0, "fp32_gflops": 290.0}}
    said = to_markdown({"optimized": {**result, "roofline": fast_fp32}}, "breakdown.png")
    assert ("the step runs at 33% of this machine's fp32 rate, its faster matmul here (95 GFLOP/s of 290; "
            "bf16 181)") in said


def test_tuned_values_come_from_winning_trials_only(tmp_path):
    requested = config(tmp_path)  # amp, channels_last, loader, num_workers, decode, malloc at `auto`
    current = resolve_auto(requested, torch.device("cpu"))
    trials = [Trial("channels_last", {"channels_last": False}, 1.30, (1.2, 1.4), win=True),
              Trial("loader", {"loader": "baseline"}, 1.04, (1.01, 1.06), win=False),
              Trial("num_workers", {"num_workers": 1}, 1.10, (1.06, 1.2), win=True),
              Trial("num_workers", {"num_workers": 2}, 1.20, (1.1, 1.3), win=True),
              Trial("batch_size", {"batch_size": 64}, 2.0, (1.9, 2.1), win=True)]  # not an `auto` knob
    tuned = tuned_settings(requested, current, trials)
    assert tuned == {"amp": current.train.amp, "channels_last": False, "loader": "fast", "num_workers": 2,
                     "decode": "cpu", "malloc": "system"}  # (no allocator trial: the default)
    # Two knobs changed and no combined trial measured them together: the plan gets no speed-up.
    assert tuned_speedup(current, tuned, trials, None) == 1.0
    combined = Trial("combined", {"channels_last": False, "num_workers": 2}, 1.5, (1.4, 1.6), win=True)
    assert tuned_speedup(current, tuned, trials, combined) == 1.5
    only_workers = {**tuned, "channels_last": current.train.channels_last}
    assert tuned_speedup(current, only_workers, trials, None) == 1.20
    assert tuned_speedup(current, {k: getattr(current.train, k) for k in tuned}, trials, None) == 1.0


def test_a_mix_of_winners_is_measured_before_it_is_kept(tmp_path, prepared):
    requested = config(tmp_path)
    current = resolve_auto(requested, torch.device("cpu"))
    base = build_setup(current, DistInfo(), open_split(prepared, "train"))
    # Pretend two knobs won alone; the combined trial measures them together for real.
    trials = [Trial("channels_last", {"channels_last": False}, 1.3, (1.2, 1.4), win=True),
              Trial("num_workers", {"num_workers": 1}, 1.1, (1.06, 1.2), win=True)]
    tuned = tuned_settings(requested, current, trials)
    kept, combined = confirm_winners(trial_ctx(current, base, requested), trials, tuned)
    assert combined is not None and combined.change == {"channels_last": False, "num_workers": 1}
    if combined.win:
        assert kept == tuned
    else:  # only the best single winner survives
        assert kept == {**tuned, "num_workers": current.train.num_workers} and "kept only" in combined.note


@pytest.mark.parametrize("second_wins", [True, False])
def test_a_single_winner_is_measured_again_before_it_is_kept(monkeypatch, tmp_path, second_wins):
    """One winning trial is not enough on a drifting VM: a second trial of its own decides."""
    requested = config(tmp_path)
    current = resolve_auto(requested, torch.device("cpu"))
    measured = []
    import cnnpipe.profile.trials as trials_mod

    monkeypatch.setattr(trials_mod, "build_setup", lambda *a: object())
    monkeypatch.setattr(trials_mod, "paired_trial", lambda knob, change, *a: measured.append((knob, change))
                        or Trial(knob, change, 1.2 if second_wins else 0.97, win=second_wins))
    flip = {"loader": "baseline" if current.train.loader == "fast" else "fast"}
    trials = [Trial("loader", flip, 1.08, (1.06, 1.36), win=True)]
    tuned = tuned_settings(requested, current, trials)
    kept, confirm = confirm_winners(trial_ctx(current, requested=requested), trials, tuned)
    assert measured == [("confirm", flip)] and confirm.knob == "confirm"
    if second_wins:
        assert kept == tuned and tuned_speedup(current, kept, trials, confirm) == 1.2
    else:
        assert kept["loader"] == current.train.loader and "default kept" in confirm.note
        assert tuned_speedup(current, kept, trials, confirm) == 1.0
    measured.clear()  # past the time box the one measured win stands, with nothing timed
    spent = TrialClock(0.0, trial_s=1.0)
    assert confirm_winners(trial_ctx(current, requested=requested, clock=spent), trials, tuned) == (tuned, None)
    assert measured == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


SOCKET_PATH_MAX = 107
"""Characters an AF_UNIX socket's path may have on Linux (108 bytes with the closing NUL)."""
MANAGER_SOCKET_EXTRA = len("/pymp-12345678/listener-12345678")
"""What a multiprocessing Manager adds to the temp folder for its socket's path."""


def test_tensorboard_profiler_plugin_lists_the_run(tmp_path, prepared):
    """The README's `tensorboard --logdir logs/profile` (tests/test_user_commands.py checks the line) lists
    the profile's run in the profiler plugin.

    TensorBoard runs with a temp folder of its own (its `.tensorboard-info` goes there, not in the
    system's), and a short one: the plugin starts a multiprocessing Manager whose socket lives in it,
    and under a temp folder of more than ~75 characters (this test's tmp_path under xdist with a
    longer user name or run number; a test's home folder inside it, as once) the Manager cannot bind,
    the plugin does not load, and its routes answer 404 for as long as anyone asks (a full CI run
    waited 600 s for a run list). A 404 fails at once, with TensorBoard's log."""
    logdir = tmp_path / "logs"
    profile_variant(config(tmp_path), DistInfo(), prepared, logdir / "optimized", False)
    runs, views, workers = profiler_plugin_reads(["tensorboard", "--logdir", str(logdir)], tmp_path, "optimized",
                                                 tmp_path / "tensorboard.log")
    assert "optimized" in runs["runs"] and "Overview" in views
    assert any(w.startswith("optimized_rank0") for w in workers)


def profiler_plugin_reads(command: list[str], cwd: Path, run: str, log: Path,
                          env: dict[str, str] | None = None) -> tuple[dict, list, list]:
    """Serve `command` (a `tensorboard --logdir ...` line) on a free port of 127.0.0.1, in `cwd`, with a
    short temp folder of its own, until the profiler plugin lists `run`; its run list, `run`'s views
    and its Overview's workers. A 404 from the plugin fails at once, with TensorBoard's log."""
    port = _free_port()
    tb = [str(Path(sys.executable).with_name("tensorboard")), *command[1:], "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryDirectory(prefix="cnnpipe-tb-") as temp, open(log, "wb") as out:
        assert len(temp) + MANAGER_SOCKET_EXTRA <= SOCKET_PATH_MAX, temp
        proc = subprocess.Popen(tb, cwd=cwd, env=dict(env or os.environ, TMPDIR=temp), stdout=out,
                                stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
        try:
            deadline = time.monotonic() + 600  # a hang guard: TensorBoard loads slowly on a loaded machine
            runs = {"runs": [], "loading": True}
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-4000:]
                try:
                    runs = _get(f"{base}/runs")
                    if run in runs["runs"] and not runs["loading"]:
                        break
                except urllib.error.HTTPError as exc:  # serving, so its plugins are loaded: this one is not
                    raise AssertionError(f"{exc.code} from the profiler plugin:\n{log.read_text()[-4000:]}") from exc
                except OSError:
                    pass  # not serving yet
                time.sleep(1)
            assert run in runs["runs"], runs
            return runs, _get(f"{base}/views?run={run}"), _get(f"{base}/workers?run={run}&view=Overview")
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_compile_is_judged_over_the_whole_run(tmp_path, prepared, monkeypatch):
    """On this machine inductor has its C++ compiler, so the trial must compile and be measured (a
    swallowed exception is a failure here); its verdict follows from its own numbers."""
    assert shutil.which("g++") or shutil.which("c++"), "inductor needs a C++ compiler on the CPU"
    import torch._inductor.codecache as codecache

    # Inductor's precompiled C++ header goes to the system temp folder whatever TORCHINDUCTOR_CACHE_DIR
    # says (its path is fixed at import): the test's own folder keeps the temp folder clean.
    headers = tmp_path / "precompiled_headers"
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(headers / "locks"))
    cfg = resolve_auto(config(tmp_path, compile="auto"), torch.device("cpu"))
    base = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    trial = compile_trial(trial_ctx(cfg, base))
    assert trial.knob == "compile" and trial.change == {"compile": "default"}
    assert trial.note.startswith("compile took"), trial.note
    run_gain = float(trial.note.split("; ")[1].split("x")[0])
    assert trial.speedup > 0 and trial.before_img_s > 0 and trial.after_img_s > 0
    assert trial.win == (trial.speedup >= 1 + cfg.profile.min_gain and trial.speedup_range[0] > 1.0
                         and run_gain >= 1 + cfg.profile.min_gain)


def test_a_compile_that_fails_is_reported_not_raised(tmp_path, prepared, monkeypatch):
    import cnnpipe.profile.trials as trials_mod

    cfg = resolve_auto(config(tmp_path), torch.device("cpu"))

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(trials_mod, "build_setup", no_compiler)
    trial = trials_mod.compile_trial(trial_ctx(cfg))
    assert not trial.win and trial.speedup == 0.0
    assert trial.note == "compile failed: RuntimeError: InvalidCxxCompiler: No working C++ compiler found"


def test_batch_growth_stops_when_a_doubling_no_longer_pays_or_memory_runs_out(monkeypatch, tmp_path):
    import cnnpipe.profile.trials as prof

    cfg = resolve_auto(config(tmp_path, batch_size=16), torch.device("cpu"))
    speeds = iter([1.10, 1.12, 1.5])  # vs the current batch: x2 pays, x4 adds under 5% over x2

    def fake_trial(knob, change, current, candidate, rounds, steps, min_gain):
        s = next(speeds)
        return Trial(knob, change, s, (s - 0.01, s + 0.01), 100.0, 100.0 * s, win=s >= 1 + min_gain)

    monkeypatch.setattr(prof, "build_setup", lambda *a: object())
    monkeypatch.setattr(prof, "paired_trial", fake_trial)
    grown = prof.batch_trials(trial_ctx(cfg), max_doublings=3)
    assert [t.change["batch_size"] for t in grown] == [32, 64]
    assert grown[0].win and not grown[1].win and "batch 32" in grown[1].note

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(prof, "build_setup", oom)
    (only,) = prof.batch_trials(trial_ctx(cfg))
    assert not only.win and only.note == "out of memory" and only.change == {"batch_size": 32}


def test_batch_growth_stops_at_the_training_images_a_process_has(monkeypatch, tmp_path):
    """A small catalog: doubling batch 16 past the split's 40 images would make the loader refuse it."""
    import types

    import cnnpipe.profile.trials as prof

    cfg = resolve_auto(config(tmp_path, batch_size=16), torch.device("cpu"))
    monkeypatch.setattr(prof, "build_setup", lambda *a: object())
    monkeypatch.setattr(prof, "paired_trial",
                        lambda knob, change, *a: Trial(knob, change, 1.5, (1.4, 1.6), 1, 1.5, True))
    base = types.SimpleNamespace(loader=types.SimpleNamespace(sampler=types.SimpleNamespace(n=40)))
    grown = prof.batch_trials(trial_ctx(cfg, base=base), max_doublings=3)
    assert [t.change["batch_size"] for t in grown] == [32, 64] and grown[0].win
    assert not grown[1].win and grown[1].note == "not measured: over the 40 training images a process has an epoch"


class FakeSetup:
    """A setup that only knows how to be stepped under another allocator (`Setup.under`)."""

    of = None

    def under(self, **process):
        view = FakeSetup()
        view.of = self
        return view


def test_smaller_batches_are_measured_for_min_steps_and_their_layout_retuned(monkeypatch, tmp_path):
    import cnnpipe.profile.smaller as prof
    import cnnpipe.profile.trials as trials_mod

    measured = []

    def fake_trial(knob, change, current, candidate, rounds, steps, min_gain):
        measured.append((knob, change))
        if knob == "channels_last":  # NCHW wins at batch 64 only
            s = 1.10 if change["batch_size"] == 64 else 0.95
            return Trial(knob, change, s, (s, s), 100.0, 100.0 * s, win=s >= 1 + min_gain)
        if knob == "malloc":  # glibc's defaults win back at batch 64 only, a step's blocks under its threshold
            assert candidate.of is current  # stepped in place, not built
            s = 1.06 if change["batch_size"] == 64 else 0.90
            return Trial(knob, change, s, (s, s), 100.0, 100.0 * s, win=s >= 1 + min_gain)
        return Trial(knob, change, 0.8, (0.75, 0.85), 100.0, 80.0, win=True)  # never a win, whatever it says

    monkeypatch.setattr(prof, "build_setup", lambda *a: FakeSetup())
    monkeypatch.setattr(trials_mod, "paired_trial", fake_trial)
    monkeypatch.setattr(trials_mod.malloc, "available", lambda: True)
    none = config(tmp_path, batch_size=256, min_steps=None)
    assert prof.smaller_batch_trials(trial_ctx(none), prof.smaller_batches(none), {}, 1.0) == []
    requested = config(tmp_path, batch_size=256, min_steps=500, channels_last="auto")  # (and `malloc: auto`)
    cfg = resolve_auto(requested, torch.device("cpu"))
    entries = prof.smaller_batch_trials(trial_ctx(cfg, requested=requested), prof.smaller_batches(cfg),
                                        {"channels_last": True, "malloc": "keep"}, 1.25)
    assert [e["change"]["batch_size"] for e in entries] == [128, 64]  # down to MIN_BATCH
    assert [k for k, _ in measured] == ["smaller_batch", "channels_last", "malloc"] * 2
    assert [c["malloc"] for k, c in measured if k == "malloc"] == ["system", "system"]
    assert not any(e["win"] for e in entries)
    assert entries[0]["at_batch"] == {} and entries[1]["at_batch"] == {"channels_last": False, "malloc": "system"}
    # Speed against the tuned recipe (1.25x the profiled one), with the re-tuned knobs' gains at 64.
    assert entries[0]["speed_vs_tuned"] == pytest.approx(0.8 / 1.25)
    assert entries[1]["speed_vs_tuned"] == pytest.approx(0.8 * 1.10 * 1.06 / 1.25)
    # Explicit settings are never re-tuned.
    measured.clear()
    fixed = config(tmp_path, batch_size=256, min_steps=500, channels_last=True, malloc="system")
    prof.smaller_batch_trials(trial_ctx(fixed), prof.smaller_batches(fixed), {}, 1.0)
    assert [k for k, _ in measured] == ["smaller_batch", "smaller_batch"]
    result = {"variant": "optimized", "step_time_median_s": 0.1, "throughput_img_s": 100.0, "fractions": {},
              "bottleneck": "compute", "recommendations": [], "trials": [], "combined_trial": None, "tuned": {},
              "batch_size": 256, "smaller_batches": entries}
    assert ("batch 64 (for train.min_steps): 0.80x the speed of batch 256; channels_last=False there (1.10x); "
            "malloc=system there (1.06x)" in summary(result))


def test_training_takes_the_values_tuned_at_its_batch(tmp_path):
    requested = config(tmp_path, batch_size=64, channels_last="auto")
    tuned = {"channels_last": True, "at_batch": {64: {"channels_last": False}, 128: {"amp": "off"}}}
    assert resolve_auto(requested, torch.device("cpu"), tuned).train.channels_last is False
    at_256 = resolve_auto(requested.with_train(batch_size=256), torch.device("cpu"), tuned)
    assert at_256.train.channels_last is True
    explicit = config(tmp_path, batch_size=64, channels_last=True)
    assert resolve_auto(explicit, torch.device("cpu"), tuned).train.channels_last is True  # params win


@pytest.mark.parametrize("candidate_times, rounds_run, win", [
    ([0.8, 0.8, 0.8], 3, True),     # 1.25x in every round
    ([0.8, 1.1, 0.8], 2, False),    # slower in round 2: cannot win any more, stops
    ([0.97, 0.97, 0.97], 3, False),  # faster every round but under min_gain
    ([10.0, 10.0, 10.0], 1, False),  # 10x slower (bf16 on a CPU without it): stops after one round
    ([1.9, 0.8, 0.8], 2, False),    # 0.53x: slower but not a clear loss, the usual two rounds
])
def test_paired_trial_win_rule(monkeypatch, candidate_times, rounds_run, win):
    import types

    import cnnpipe.profile.trials as prof

    current, candidate = types.SimpleNamespace(images_per_step=100), types.SimpleNamespace(images_per_step=100)
    calls = {"current": 0, "candidate": 0}

    def fake_block(s, steps):
        name = "current" if s is current else "candidate"
        calls[name] += 1
        return [1.0] * steps if s is current else [candidate_times[calls[name] - 1]] * steps

    monkeypatch.setattr(prof, "_block", fake_block)
    trial = prof.paired_trial("amp", {"amp": "bf16"}, current, candidate, rounds=3, steps=2, min_gain=0.05)
    assert calls == {"current": rounds_run, "candidate": rounds_run} and trial.win == win
    assert trial.before_img_s == 100.0
    assert ("stopped after 2 rounds" in trial.note) == (rounds_run == 2)
    assert ("stopped after 1 round" in trial.note) == (rounds_run == 1)


def test_trials_follow_the_diagnosis(tmp_path):
    requested = config(tmp_path, "baseline")  # explicit settings: no `auto` knob
    cfg = resolve_auto(requested, torch.device("cpu"))
    def knobs(rec):
        return {k for k, _ in candidates(cfg, requested, torch.device("cpu"), rec)}
    assert knobs(set()) == {"amp", "channels_last", "loader"}
    assert "num_workers" in knobs({"loader"})  # an input-bound naive loader: workers are the other fix
    assert "pin_memory" not in knobs({"num_workers"})  # no host-to-device copy to speed up on the CPU
    assert knobs({"num_workers"}) >= {"num_workers"}


def test_the_allocator_is_measured_when_auto_or_asked_for_and_after_every_other_trial(monkeypatch, tmp_path):
    """Once its blocks set `keep`, glibc's own thresholds are gone for the process: it is timed after
    the other knobs and the batch's growth, even as the diagnosis's first pick."""
    import cnnpipe.profile.trials as trials_mod

    requested = config(tmp_path)  # the optimized recipe: `malloc: auto`
    cfg = resolve_auto(requested, torch.device("cpu"))
    assert candidates(cfg, requested, torch.device("cpu"), [])[-1] == ("malloc", {"malloc": "keep"})
    ordered = [k for k, _ in candidates(cfg, requested, torch.device("cpu"), ["malloc", "loader"])]
    assert ordered[0] == "loader" and ordered[-1] == "malloc"  # the diagnosis's picks first, the allocator last
    timed = []
    monkeypatch.setattr(trials_mod.malloc, "available", lambda: True)
    monkeypatch.setattr(trials_mod, "build_setup", lambda *a: object())
    monkeypatch.setattr(trials_mod, "paired_trial", lambda knob, change, *a: timed.append(knob) or Trial(knob, change))
    monkeypatch.setattr(trials_mod, "process_trial",
                        lambda ctx, knob, change: timed.append(knob) or Trial(knob, change))
    monkeypatch.setattr(trials_mod, "batch_trials", lambda ctx: timed.append("batch_size") or [])
    results = trials_mod.run_trials(trial_ctx(cfg, requested=requested), ["malloc", "loader"])
    assert timed[0] == "loader" and timed[-2:] == ["batch_size", "malloc"] and results[-1].knob == "malloc"
    baseline = config(tmp_path, "baseline")  # `malloc: system`, set by hand
    base_cfg = resolve_auto(baseline, torch.device("cpu"))
    assert "malloc" not in {k for k, _ in candidates(base_cfg, baseline, torch.device("cpu"), [])}
    assert ("malloc", {"malloc": "keep"}) in candidates(base_cfg, baseline, torch.device("cpu"), ["malloc"])


def test_the_diagnosiss_pick_of_the_allocator_keeps_its_time_while_the_others_run(monkeypatch, tmp_path):
    """Measured last, not dropped: where the diagnosis picked the allocator (`page_faults`), the
    clock keeps its trial's time in reserve (`reserved_s`) while the other candidates run; unpicked,
    it gets what is left."""
    import cnnpipe.profile.trials as trials_mod

    now = [0.0]

    def timed(knob, change, *a):  # every trial takes 4 s of the fake clock
        now[0] += 4.0
        return Trial(knob, change, 1.0)

    offered = [("amp", {"amp": "off"}), ("loader", {"loader": "baseline"}), ("malloc", {"malloc": "keep"})]
    monkeypatch.setattr(trials_mod, "candidates", lambda *a: offered)
    monkeypatch.setattr(trials_mod, "build_setup", lambda *a: object())
    monkeypatch.setattr(trials_mod, "paired_trial", timed)
    monkeypatch.setattr(trials_mod, "process_trial", lambda ctx, knob, change: timed(knob, change))
    cfg = config(tmp_path)

    def measured(recommended):
        now[0] = 0.0
        clock = TrialClock(window_s=10.0, trial_s=4.0, now=lambda: now[0])  # room for two 4 s trials
        results = trials_mod.run_trials(trial_ctx(cfg, clock=clock), recommended, grow_batch=False)
        assert clock.window_s == 10.0 and clock.reserved_s == 0.0  # (the window as set; the hold given back)
        return [r.knob for r in results if r.speedup]

    assert measured(["malloc", "amp"]) == ["amp", "malloc"]  # 4 s held for it: one other trial fits
    assert measured(["amp"]) == ["amp", "loader"]  # unpicked: the two others took the window


def test_each_block_of_a_trial_steps_under_its_own_allocator(monkeypatch, tmp_path, prepared):
    """The allocator is the process's: the A/B blocks switch it with every block, warm-up step included,
    on one setup stepped in place (`Setup.under`: one model, one optimizer, one place in the epoch)."""
    from cnnpipe.profile import measure

    cfg = resolve_auto(config(tmp_path, malloc="keep"), torch.device("cpu"))
    kept = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
    system = kept.under(malloc="system")
    assert system.cfg.train.malloc == "system" and kept.cfg.train.malloc == "keep"
    assert system.ctx is kept.ctx and system.loader is kept.loader and system.feed is kept.feed
    weights = [p.detach().clone() for p in kept.ctx.model.parameters()]
    stepped = []
    monkeypatch.setattr(measure, "use_malloc", stepped.append)
    # both rounds, whatever the speeds: a busy machine can slow one tiny block past the clear-loss stop
    monkeypatch.setattr("cnnpipe.profile.trials.CLEAR_LOSS", 0.0)
    trial = paired_trial("malloc", {"malloc": "system"}, kept, system, rounds=2, steps=1, min_gain=0.05)
    assert trial.before_img_s > 0 and trial.after_img_s > 0
    assert stepped == ["keep"] * 2 + ["system"] * 4 + ["keep"] * 2  # ABBA, an untimed step and a timed one each
    assert any(not torch.equal(w, p) for w, p in zip(weights, kept.ctx.model.parameters()))  # (its own model trained)
    with pytest.raises(ValueError, match="channels_last"):
        kept.under(channels_last=False)  # a layout is the model's: a trial builds a second setup for it


class SizedSetup(FakeSetup):
    """A fake setup at a batch: what a process knob's trial reads of it."""

    def __init__(self, cfg, batch):
        self.cfg, self.images_per_step = cfg.with_train(batch_size=batch), batch

    def under(self, **process):
        view = SizedSetup(self.cfg.with_train(**process), self.images_per_step)
        view.of = self
        return view


def test_the_allocator_is_tried_at_the_measured_batch_not_the_halved_trial_batch(monkeypatch, tmp_path):
    """Its gain depends on the size of a step's blocks: the trial steps the measured setup in place,
    at its batch, in blocks of about the trial batch's images; where such a trial does not fit the
    clock, it is noted as not measured. A win is confirmed the same way, not at the trial batch."""
    import cnnpipe.profile.trials as prof
    from cnnpipe.profile import decision

    paired = []
    monkeypatch.setattr(prof.malloc, "available", lambda: True)
    monkeypatch.setattr(prof, "candidates", lambda *a: [("malloc", {"malloc": "keep"})])
    monkeypatch.setattr(prof, "batch_trials", lambda *a, **k: [])
    monkeypatch.setattr(prof, "paired_trial", lambda knob, change, current, candidate, rounds, steps, gain:
                        paired.append((knob, current, candidate, steps)) or Trial(knob, change, 1.2, (1.1, 1.3),
                                                                                   win=True))
    monkeypatch.setattr(prof, "build_setup", lambda *a: pytest.fail("a process knob's trial builds nothing"))
    cfg = config(tmp_path, batch_size=64)  # (the tests' profile: 2 rounds)
    measured, small = SizedSetup(cfg, 64), SizedSetup(cfg, 16)
    # a 0.1 s step at batch 64: blocks of 4 steps there (the clock's 0.4 s), 8 at batch 16;
    # 2 rounds of 2 blocks of 1 + 4 steps take 2.0 s, where the usual trial takes 30 s
    clock = TrialClock(window_s=80.0, block=8, trial_s=30.0, now=lambda: 0.0)
    ctx = dataclasses.replace(trial_ctx(cfg, base=measured, clock=clock), measured_step_s=0.1).at(small)
    assert ctx.measured is measured and ctx.base is small and prof.extra_s(ctx, "malloc") == pytest.approx(2.0 - 30)
    trial = prof.run_trials(ctx, [], grow_batch=False)[-1]  # (after the batch's note)
    (knob, current, candidate, steps), = paired
    assert current is measured and candidate.of is measured and candidate.cfg.train.malloc == "keep"
    assert steps == 4 and trial.win and trial.note == "at batch 64"
    assert clock.trial_s == 30.0  # (not the next trials' length: nothing was built)
    tuned, confirm = decision.confirm_winners(ctx, [trial], {"malloc": "keep"})
    assert tuned == {"malloc": "keep"} and confirm.knob == "confirm" and paired[-1][1] is measured
    clock.window_s = 1.9  # 2.0 s of blocks at batch 64: past the window
    unmeasured = prof.run_trials(ctx, [], grow_batch=False)[-1]
    assert unmeasured.note == prof.NOT_AT_TRAINING_BATCH.format(measured=64, trial=16) and not unmeasured.win
    assert len(paired) == 2


def test_candidates_the_hardware_rules_out_are_not_timed_unless_asked(monkeypatch, tmp_path):
    """bf16 on a CPU without avx512_bf16/amx_bf16: noted, not measured (minutes saved on such CPUs)."""
    import cnnpipe.profile.trials as trials_mod

    timed = []
    monkeypatch.setattr(trials_mod, "cpu_has_fast_bf16", lambda: False)
    two = [("amp", {"amp": "bf16"}), ("loader", {"loader": "baseline"})]
    monkeypatch.setattr(trials_mod, "candidates", lambda *a: two)
    monkeypatch.setattr(trials_mod, "build_setup", lambda *a: object())
    monkeypatch.setattr(trials_mod, "batch_trials", lambda *a, **k: [])
    monkeypatch.setattr(trials_mod, "paired_trial",
                        lambda knob, change, *a: timed.append(knob) or Trial(knob, change, 0.9))
    cfg = config(tmp_path, amp="off")
    results = trials_mod.run_trials(trial_ctx(cfg), set())
    assert timed == ["loader"] and results[0].note.startswith("not measured") and not results[0].win
    forced = resolve(load_params(write_params(tmp_path / "forced.yaml", {**tiny_params(),
                     "profile": {**tiny_params()["profile"], "trial_ruled_out": True}})), "optimized")
    trials_mod.run_trials(trial_ctx(forced), set())
    assert timed == ["loader", "amp", "loader"]
    monkeypatch.setattr(trials_mod, "cpu_has_fast_bf16", lambda: True)
    assert trials_mod.ruled_out({"amp": "bf16"}, torch.device("cpu")) == ""


def test_smaller_batches_are_those_min_steps_may_pick(tmp_path):
    from cnnpipe.profile.smaller import smaller_batches

    assert smaller_batches(config(tmp_path, batch_size=256, min_steps=300)) == [128, 64]
    assert smaller_batches(config(tmp_path, batch_size=256, min_steps=None)) == []


def test_a_spent_time_box_notes_the_remaining_trials_instead_of_timing_them(monkeypatch, tmp_path):
    """profile.budget_share: once the stage has used its share of the budget, nothing new is timed,
    and two single wins are not shipped together unmeasured."""
    import cnnpipe.profile.trials as trials_mod

    timed = []
    monkeypatch.setattr(trials_mod, "build_setup", lambda *a: object())
    monkeypatch.setattr(trials_mod, "paired_trial",
                        lambda knob, change, *a: timed.append(knob) or Trial(knob, change, 0.9))
    cfg = config(tmp_path)
    spent = TrialClock(0.0, trial_s=1.0)
    results = trials_mod.run_trials(trial_ctx(cfg, clock=spent), set())
    assert timed == [] and results and all(r.note == OUT_OF_TIME for r in results)
    assert [r.knob for r in results][-2:] == ["batch_size", "malloc"] and not any(r.win for r in results)
    wins = [Trial("amp", {"amp": "off"}, 1.2, win=True), Trial("loader", {"loader": "baseline"}, 1.1, win=True)]
    requested = config(tmp_path, amp="auto", loader="auto")
    current = resolve_auto(requested, torch.device("cpu"))
    kept, combined = confirm_winners(trial_ctx(current, requested=requested, clock=spent), wins,
                                      tuned_settings(requested, current, wins))
    assert kept["amp"] == "off" and kept["loader"] == current.train.loader
    assert combined.note.startswith("not measured") and "kept only amp=off" in combined.note


def test_the_breakdown_compares_recipes_per_image_not_per_step(tmp_path, monkeypatch):
    """A batch-256 recipe at 256 img/s steps 4x longer than a batch-64 one at 141 img/s but is faster
    per image: the chart's bars are time per 1,000 images, each labelled with batch and img/s."""
    from cnnpipe.profile import report

    fractions = {"forward": 0.3, "backward": 0.7}
    profiles = {"optimized": {"step_time_median_s": 1.0, "batch_size": 256, "throughput_img_s": 256.0,
                              "fractions": fractions},
                "baseline": {"step_time_median_s": 0.454, "batch_size": 64, "throughput_img_s": 141.0,
                             "fractions": fractions}}
    drawn = {}

    def barh(self, names, widths, left, **kwargs):
        drawn.setdefault(tuple(names), [0.0] * len(names))
        drawn[tuple(names)] = [a + b for a, b in zip(drawn[tuple(names)], widths)]

    import matplotlib.axes

    texts = []
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", barh)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, x, y, s, **kw: texts.append(s))
    report.bar_chart(profiles, tmp_path / "b.png")
    (total,) = drawn.values()
    assert total == pytest.approx([1000 / 256, 0.454 / 64 * 1000])  # seconds per 1,000 images
    assert total[0] < total[1]
    assert texts == ["  batch 256, 256 img/s", "  batch 64, 141 img/s"]
