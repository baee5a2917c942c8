"""`swarm experiment throttled`'s bookkeeping without swarms: rows from steps.csv rows, rho, the speed-up share,
the targets, the slow cells' step count and `--baseline torch` (its runner faked)."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from swarm.experiments import throttled as th
from swarm.experiments import throttled_report as thr
from swarm.experiments.throttled import Cell, ThrottledConfig


def _steps(n: int, step_s: float, fwd: int, bwd: int, total: int = 0, fp32_total: int = 0) -> list[dict]:
    """steps.csv rows as DictReader gives them (strings), the first epoch (4 steps) 3x slower and 2x bigger."""
    rows = []
    for i in range(n):
        first = i < 4
        rows.append(
            {"step": str(i + 1), "step_s": str(step_s * (3 if first else 1)), "train_loss": "2.5",
             "forward_bytes": str(fwd), "backward_bytes": str(bwd), "fp32_wire_bytes": "800000",
             "sync_bytes": "1000", "control_bytes": "500",
             "total_wire_bytes": str(total * (2 if first else 1)), "fp32_total_wire_bytes": str(fp32_total)}
        )  # fmt: skip
    return rows


def _rows(totals: bool = True, predicted: float | None = 8.8) -> list[dict]:
    t = (lambda x: x) if totals else (lambda x: 0)
    cells = [
        (Cell(None, "fp32/fp32"), _steps(12, 0.1, 400_000, 400_000, t(802_000), t(802_000)), 0.1),
        (Cell(1.0, "fp32/fp32"), _steps(12, 6.5, 400_000, 400_000, t(802_000), t(802_000)), 6.4),
        (Cell(1.0, "aqsgd2/gradq4"), _steps(12, 0.8, 25_000, 50_000, t(80_000), t(802_000)), predicted),
    ]
    summaries = [{"predicted_step_s": p} if p else {} for *_, p in cells]
    return [th.summarize(c, s, 4, 8, summ) for (c, s, _), summ in zip(cells, summaries, strict=True)]


def test_rho_share_and_totals():
    rows = _rows()
    ratios = th.add_comparisons(rows)
    fp32_slow, aq = rows[1], rows[2]
    # the busier direction: a boundary direction plus half of the rest (tied sync, control), 2 epochs of 8
    busiest = (4 * (400_000 + 804_000 / 2) + 8 * (400_000 + 2_000 / 2)) / 12
    assert ratios == {1.0: pytest.approx(busiest * 8 / 1e6 / 0.1)} and aq["rho"] == ratios[1.0] == fp32_slow["rho"]
    assert ratios[1.0] >= 20  # 1 Mbit/s is the rho >= 20 regime of the issue
    assert aq["speedup_vs_fp32"] == pytest.approx(6.5 / 0.8)
    # against what the fp32 cell at the same rate sent per step (not the cell's own raw fp32 equivalent)
    assert aq["total_ratio_vs_fp32"] == pytest.approx((4 * 1_604_000 + 8 * 802_000) / (16 * 80_000))
    assert aq["total_steady_ratio_vs_fp32"] == pytest.approx(802_000 / 80_000)
    # the share divides by min(steady byte ratio, 1 + rho): here the byte ratio is the smaller bound
    assert aq["speedup_share"] == pytest.approx((6.5 / 0.8) / (802_000 / 80_000))
    assert fp32_slow["speedup_share"] == pytest.approx(1.0) and rows[0]["rho"] is None
    assert aq["predicted_error_pct"] == pytest.approx(100 * (8.8 - 0.8) / 0.8)
    assert (aq["sync_bytes"], aq["control_bytes"], aq["total_wire_bytes"]) == (12_000, 6000, 16 * 80_000)


def test_targets_judge_prediction_and_share(monkeypatch):
    monkeypatch.setattr(th, "TARGET_SETTING", "aqsgd2/gradq4")
    rows = _rows(predicted=0.84)
    th.add_comparisons(rows)
    (prediction, met), (share, share_met) = th.check_targets(rows)
    assert met is True and "worst +5.0% at 1 Mbit/s aqsgd2/gradq4" in prediction
    assert share_met is True and f"rho {rows[2]['rho']:.1f}" in share and "81%" in share
    rows[0]["predicted_error_pct"] = -12.0  # one cell off by more than 10% misses the target
    assert th.check_targets(rows)[0][1] is False
    report = thr.report_markdown(rows, {1.0: rows[1]["rho"]})
    assert (
        "## Targets" in report and "[MISSED] predicted step time" in report and "| 1 Mbit/s | aqsgd2/gradq4 |" in report
    )


def test_without_totals_or_predictions_nothing_is_judged_met(monkeypatch):
    monkeypatch.setattr(th, "TARGET_SETTING", "aqsgd2/gradq4")
    rows = _rows(totals=False, predicted=None)
    for r in rows:
        r["predicted_step_s"] = r["predicted_error_pct"] = None
    th.add_comparisons(rows)
    assert rows[2]["total_ratio_vs_fp32"] is None and rows[2]["speedup_share"] is None
    assert [met for _, met in th.check_targets(rows)] == [None, None]
    report = thr.report_markdown(rows, {})  # renders with the missing values as '-'
    assert "| 1 Mbit/s | aqsgd2/gradq4 | 0.800 | - |" in report
    rows[1]["rho"] = rows[2]["rho"] = 12.4
    assert "no such cell (highest rho 12.40)" in th.check_targets(rows)[1][0]


def test_bits_of_any_codec_label():
    assert [th._bits(c) for c in ("fp32", "bf16", "aqsgd2+ch", "gradq4+ef+rot", "directq4+nr")] == [32, 16, 2, 4, 4]


def test_slow_cells_run_fewer_steps_and_default_matrix_has_1_mbit():
    cfg = ThrottledConfig(steps=40, slow_steps=12)
    assert 1.0 in cfg.rates and th.SLOW_RATE_MBIT > 1.0
    assert cfg.steps_of(Cell(1.0, "fp32/fp32")) == 12 and cfg.steps_of(Cell(10.0, "fp32/fp32")) == 40
    assert cfg.steps_of(Cell(None, "fp32/fp32")) == 40 and ThrottledConfig(steps=8).steps_of(Cell(10.0, "x/y")) == 8
    with pytest.raises(ValueError):
        ThrottledConfig(slow_steps=0)
    with pytest.raises(ValueError):
        ThrottledConfig(slow_codec_steps=0)


def test_slow_compressed_cells_run_long_enough_that_a_full_bucket_does_not_set_their_mean():
    # s22's 1 Mbit/s default cell: 12 steps, 8 after the first epoch, two 64 KiB refills of about 0.5 s of link
    # each: 0.195 s measured for a link-bound 0.28 s. Its compressed cells now run 64 steps (at least `steps`)
    cfg = ThrottledConfig(steps=40, slow_steps=12)
    assert cfg.steps_of(Cell(1.0, th.DEFAULT_CODECS)) == 64 and cfg.steps_of(Cell(1.0, "directq2/gradq4")) == 64
    assert ThrottledConfig(steps=80).steps_of(Cell(1.0, "directq2/gradq4")) == 80
    assert cfg.steps_of(Cell(1.0, "fp32/fp32")) == 12  # fp32 takes ~5 s a step there: 12 as before
    refills_s = 2 * 65536 / 125e3  # both directions' buckets at 1 Mbit/s, once each
    steady = cfg.steps_of(Cell(1.0, th.DEFAULT_CODECS)) - cfg.train_samples // cfg.batch_size
    assert refills_s / (steady * 0.28) < 0.07
    note = th.slow_steps_note(cfg)
    assert "fp32 ran 12 of 40" in note and "compressed settings 64" in note
    assert th.slow_steps_note(ThrottledConfig(rates=(10.0,))) == ""
    assert th.config_from_args(_args("--slow-codec-steps", "20")).slow_codec_steps == 20
    # the peers' learning-rate schedule spans what each cell trains: fp32's 12 are a prefix of the 40-step schedule,
    # the compressed cells' 64 get a 64-step one (they warned that their schedule ended at step 40)
    assert th.peer_config(Cell(1.0, "fp32/fp32"), cfg).optim.total_steps == 40
    assert th.peer_config(Cell(1.0, th.DEFAULT_CODECS), cfg).optim.total_steps == 64
    assert th.peer_config(Cell(10.0, th.DEFAULT_CODECS), cfg).optim.total_steps == 40


def test_the_calibration_window_is_read_from_the_plan_and_compared_with_the_trainers_steps():
    plan = {"A": {"first_step": 4, "steps": 3, "step_s": 0.2}, "B": {"first_step": 5, "steps": 4, "step_s": 0.25}}
    assert th.calibration_window(plan) == {"first": 5, "last": 7, "clock_s": 0.25}
    assert th.calibration_window({"A": {"steps": 3, "step_s": 0.2}}) is None  # an older plan
    assert th.calibration_window({"A": {"first_step": "x", "steps": 3, "step_s": 0.2}}) is None
    assert th.calibration_window([]) is None
    steps = [{"step": str(i), "step_s": str(0.1 * i), "train_loss": "3.0"} for i in range(1, 9)]
    row = th.summarize(Cell(None, "fp32/fp32"), steps, 4, 8, {"calibration_window": th.calibration_window(plan)})
    assert row["window_steps"] == [5, 7] and row["window_step_s"] == pytest.approx(0.6)
    assert row["window_clock_s"] == 0.25


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    th.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_torch_baseline_needs_netns(tmp_path):
    with pytest.raises(ValueError, match="needs --netns"):
        th.config_from_args(_args("--baseline", "torch"))
    with pytest.raises(SystemExit, match="needs --netns"):
        th.run(_args("--baseline", "torch", "--out", str(tmp_path)))
    with pytest.raises(SystemExit):
        _args("--baseline", "jax")  # argparse refuses an unknown baseline
    assert th.config_from_args(_args("--baseline", "torch", "--netns")).baseline == "torch"


def test_torch_rows_join_the_table_and_report(tmp_path, monkeypatch):
    calls = []

    def run_torch_rows(cfg, rates, out, say=print):
        calls.append((cfg.baseline, list(rates), out))
        return [
            {"setting": "torch-fp32", "rate_mbit": rate, "mean_step_s": 5.0 if rate else 0.08,
             "first_epoch_step_s": 5.0, "throughput_samples_per_s": 1.6, "wire_bytes": 9_600_000,
             "total_wire_bytes": 9_600_000, "final_loss": 2.5, "steps": 12}
            for rate in rates
        ]  # fmt: skip

    monkeypatch.setitem(
        sys.modules, "swarm.experiments.torch_baseline", types.SimpleNamespace(run_torch_rows=run_torch_rows)
    )
    cfg = ThrottledConfig(rates=(1.0, None), netns=True, baseline="torch")
    rows = _rows() + th._run_baseline(cfg, tmp_path, print)
    assert calls == [("torch", [1.0, None], tmp_path)]
    th.add_comparisons(rows)
    torch_slow = next(r for r in rows if r["setting"] == "torch-fp32" and r["rate_mbit"] == 1.0)
    assert torch_slow["speedup_vs_fp32"] == pytest.approx(6.5 / 5.0) and torch_slow["fw_bits"] == 32
    lines = thr.torch_comparison(rows)
    assert lines[0].startswith(
        "- 1 Mbit/s: swarm fp32 6.500 s/step, torch fp32 5.000 s/step: swarm's fp32 is 1.30x slower"
    )
    assert "unshaped" in lines[1] and "swarm's fp32 is 1.25x slower" in lines[1]
    report = thr.report_markdown(rows, {1.0: rows[1]["rho"]})
    assert "PyTorch's pipeline" in report and "torch-fp32" in report


def test_torch_rows_run_the_cells_steps_of_the_same_schedule(tmp_path, monkeypatch):
    import swarm.experiments.torch_baseline as tb

    runs = []

    def run_torch(run, folder, places, master, deadline_s):
        runs.append(run)
        return []

    monkeypatch.setattr(tb, "run_torch", run_torch)
    monkeypatch.setattr(tb, "summarize_torch", lambda rate, records, per_epoch, batch: {"rate_mbit": rate})
    cfg = ThrottledConfig(rates=(1.0, 10.0), steps=40, slow_steps=12)
    tb.run_torch_rows(cfg, [1.0, 10.0], tmp_path, say=lambda _: None)
    assert [(r.steps, r.total_steps) for r in runs] == [(12, 40), (40, 40)]  # 40 steps at 1 Mbit/s before


def test_cells_warm_up_over_a_fifth_of_the_schedule():
    assert th.warmup_steps(40) == 8 and th.warmup_steps(8) == 2 and th.warmup_steps(2) == 1  # 10% before


ONE_STAGE = [{"layer_start": 0, "layer_end": 4, "peer_ids": ["p"]}]


def test_a_calibrated_plan_gives_the_cells_prediction(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"predicted_step_s": 0.05, "mean_step_s": 0.12}))
    assert th.read_summary(tmp_path)["predicted_step_s"] == 0.05  # no plan file: the trainer's own
    (tmp_path / "plan.json").write_text(json.dumps({"stages": ONE_STAGE, "step_time_s": 0.2}))
    assert th.read_summary(tmp_path)["predicted_step_s"] == 0.05  # the newest plan, not calibrated
    calibrated = {"stages": ONE_STAGE, "step_time_s": 0.118, "measured": {}, "first_step_time_s": 0.05}
    (tmp_path / "plan.json").write_text(json.dumps(calibrated))
    (tmp_path / "summary.json").write_text(json.dumps({"predicted_step_s": 0.118, "mean_step_s": 0.12}))
    summary = th.read_summary(tmp_path)  # the trainer followed the calibrated plan: its first comes from the plan
    assert summary["predicted_step_s"] == 0.118 and summary["first_plan_step_s"] == 0.05


def test_a_cell_names_the_state_its_peers_moved_beside_its_totals(tmp_path):
    from swarm.metrics import STATE_SENT_LOG

    (tmp_path / "summary.json").write_text(json.dumps({"predicted_step_s": 0.05}))
    assert th.read_summary(tmp_path)["state_bytes"] is None, "no logs: not read"
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "peer0.log").write_text(f"INFO swarm.runtime.service: {STATE_SENT_LOG} 4000 bytes (stage 1)\n")
    (tmp_path / "logs" / "peer1.log").write_text(f"INFO swarm.runtime.service: {STATE_SENT_LOG} 600 bytes (stage 0)\n")
    summary = th.read_summary(tmp_path)
    assert summary["state_bytes"] == 4600
    row = th.summarize(Cell(1.0, "fp32/fp32"), _steps(8, 0.1, 1, 1), 4, 8, summary)
    assert (
        row["state_bytes"] == 4600
        and row["total_wire_bytes"]
        == th.summarize(Cell(1.0, "fp32/fp32"), _steps(8, 0.1, 1, 1), 4, 8, {})["total_wire_bytes"]
    ), "named beside the totals, not in them"


def test_namespace_cells_calibrate_their_plan_and_keep_the_newest(tmp_path, monkeypatch):
    """A --netns cell's peers calibrate after the first epoch as the app-shaped cells' do (uncalibrated, their
    plans predicted the block speed alone, 43-57% below measured), in namespaces of the run's own prefix, and the
    DHT's newest plan is kept before the testbed goes down."""
    import swarm.testbed.testbed_cli as tc

    seen = {}

    def run_in_testbed(rate, peer, train_cfg, peers, nat=(), before_down=None, prefix="swt-"):
        seen.update(rate=rate, calibrate=peer.planning.calibrate_after_steps, prefix=prefix, out=train_cfg.out)
        before_down("testbed")
        return [{"step": "1"}]

    saved = []
    monkeypatch.setattr(tc, "run_in_testbed", run_in_testbed)
    monkeypatch.setattr(th, "_save_testbed_plan", lambda testbed, cell_dir: saved.append((testbed, cell_dir)))
    cfg = ThrottledConfig(rates=(10.0,), netns=True, netns_prefix="swov-", train_samples=32, batch_size=8)
    cell = Cell(10.0, "fp32/fp32")
    assert th._run_cell(cell, cfg, tmp_path) == [{"step": "1"}]
    assert seen == {"rate": 10.0, "calibrate": 4, "prefix": "swov-", "out": str(tmp_path / cell.label)}
    assert saved == [("testbed", tmp_path / cell.label)]


def test_the_namespace_prefix_is_checked_and_names_the_baselines():
    assert ThrottledConfig().baseline_prefix == "swtq-"  # the baseline's namespaces as before
    assert ThrottledConfig(netns_prefix="swov-").baseline_prefix == "swovq-"
    for bad in ("swt", "SWT-", "toolong-", "-", "a b-"):
        with pytest.raises(ValueError, match="--netns-prefix"):
            ThrottledConfig(netns_prefix=bad)


def test_a_testbeds_newest_plan_is_saved_from_its_status(tmp_path, monkeypatch):
    import subprocess

    node = types.SimpleNamespace(namespace="swov-trainer", service=types.SimpleNamespace(address="10.77.0.3"))
    testbed = types.SimpleNamespace(run_dir=tmp_path, layout=types.SimpleNamespace(node=lambda name: node))
    document = {"stages": ONE_STAGE, "step_time_s": 0.118, "measured": {}, "first_step_time_s": 0.05}
    answer = json.dumps({"plan": {"version": 3, "plan": document}})
    replies = iter([
        types.SimpleNamespace(returncode=1, stdout=""),  # the DHT did not answer: nothing is written
        types.SimpleNamespace(returncode=0, stdout="not json"),
        types.SimpleNamespace(returncode=0, stdout=answer),
        subprocess.TimeoutExpired(["swarm"], 120, output=answer.encode()),  # answered, then hung on its way out
        OSError("no ip command"),
    ])  # fmt: skip
    argvs = []

    def run(argv, **kw):
        argvs.append(argv)
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(subprocess, "run", run)
    for _ in range(2):
        th._save_testbed_plan(testbed, tmp_path)
        assert not (tmp_path / "plan.json").exists()
    th._save_testbed_plan(testbed, tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text()) == document
    assert argvs[0][:4] == ["ip", "netns", "exec", "swov-trainer"] and "status" in argvs[0]
    (tmp_path / "plan.json").unlink()
    th._save_testbed_plan(testbed, tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text()) == document
    th._save_testbed_plan(testbed, tmp_path)  # the command cannot run: the file stays as it was
    assert json.loads((tmp_path / "plan.json").read_text()) == document


def test_a_cell_the_planner_moved_onto_fewer_stages_is_named_not_judged_clean(monkeypatch):
    # seen at 1 Mbit/s in namespaces: from step 21 the planner ran the cell's model on one peer
    monkeypatch.setattr(th, "TARGET_SETTING", "aqsgd2/gradq4")
    rows = _rows(predicted=0.84)
    steps = _steps(12, 0.8, 25_000, 50_000, 80_000, 802_000)
    for s in steps:
        s["stages"] = "2" if int(s["step"]) < 9 else "1"
    shrunk = th.summarize(Cell(1.0, "aqsgd2/gradq4"), steps, 4, 8, {"predicted_step_s": 0.84})
    assert (shrunk["stages"], shrunk["fewest_stages"], shrunk["fewer_stages_from_step"]) == (2, 1, 9)
    assert rows[2]["fewer_stages_from_step"] is None and rows[2]["stages"] is None, "no stages column: nothing said"
    rows[2] = shrunk
    th.add_comparisons(rows)
    judged = dict(th.check_targets(rows))
    (statement,) = [s for s in judged if s.startswith("every cell kept")]
    assert judged[statement] is False and "ran on 1 of 2 stages from step 9" in statement


def test_the_rows_carry_the_trainers_measured_phase_split_and_the_report_shows_it():
    # steps.csv gives each step's own seconds per phase; an empty cell is a phase that took no time that step
    steps = _steps(12, 0.1, 400_000, 400_000, 802_000, 802_000)
    for s in steps:
        first = int(s["step"]) <= 4  # the first epoch is slower: not in the median
        s[f"{th.PHASE_COLUMN}pipeline}}"], s[f"{th.PHASE_COLUMN}reduce}}"] = str(0.3 if first else 0.08), "0.01"
    steps[7][f"{th.PHASE_COLUMN}reduce}}"] = ""
    epilogue = {"tails": "0", "predicted_compute_s": 0.07, "predicted_transfer_s": 0.01}
    row = th.summarize(Cell(100.0, "fp32/fp32"), steps, 4, 8, {"epilogue": epilogue})
    assert row["phase_ms"] == pytest.approx({"pipeline": 80.0, "reduce": 10.0})
    torch_like = th.summarize(Cell(100.0, "fp32/fp32"), _steps(12, 0.1, 1, 1, 2, 2), 4, 8, {})
    assert torch_like["phase_ms"] == {}, "no phase columns: no split, not zeros"
    rows = [row]
    th.add_comparisons(rows)
    text = thr.report_markdown(rows, {})
    assert "## Where a step's time went (measured)" in text
    assert "| mean step (ms) | pipeline | reduce |" in text and "| 80.0 | 10.0 | 0 | 0.070 + 0.010 |" in text


def test_stages_below_peers_plan_replicas_and_a_sel_setting_plans_the_sums_codecs():
    from swarm.daemon.peer_config import peer_flags

    cfg = ThrottledConfig(peers=4, stages=2, settings=("fp32/fp32", th.DEFAULT_CODECS, f"{th.DEFAULT_CODECS}@sel"))
    plain, selective = (th.peer_config(Cell(None, s), cfg) for s in cfg.settings[1:])
    assert plain.num_stages == selective.num_stages == 2 and plain.planning.replicas == selective.planning.replicas == 2
    assert plain.planning.codec_policy == "fixed" and selective.planning.codec_policy == "selective"
    assert (selective.fw_codec.label, selective.bw_codec.label) == (plain.fw_codec.label, plain.bw_codec.label)
    argv = peer_flags().to_argv(selective)
    assert argv[argv.index("--codec-policy") + 1] == "selective" and argv[argv.index("--replicas") + 1] == "2"
    one_each = th.peer_config(Cell(None, th.DEFAULT_CODECS), ThrottledConfig(peers=3))
    assert one_each.num_stages == 3 and one_each.planning.replicas == 0  # as before: one stage a peer
    row = th.summarize(
        Cell(None, f"{th.DEFAULT_CODECS}@sel"), [s | {"reduce_bytes": "3000"} for s in _steps(8, 0.1, 1, 1)], 4, 8
    )
    assert (row["fw_bits"], row["bw_bits"]) == (2, 2) and row["reduce_bytes_per_step"] == 3000


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"peers": 4, "stages": 3}, "--stages 3"), ({"peers": 2, "stages": 0}, "--stages 0"),
     ({"peers": 4, "stages": 2, "netns": True}, "--netns"), ({"settings": ("fp32/fp32", "a/b@lr8")}, "a/b@lr8"),
     ({"settings": ("fp32",)}, "'fp32'")],
)  # fmt: skip
def test_stages_that_do_not_divide_the_peers_and_unknown_suffixes_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        ThrottledConfig(**fields)


def test_a_cells_row_carries_the_sums_codecs_its_newest_plan_chose(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"predicted_step_s": 0.05}))
    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["a", "b"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["c", "d"]},
    ]
    epilogue = {"average": ["bf16", "fp32"], "tied": "fp32", "why": "quickest"}
    (tmp_path / "plan.json").write_text(json.dumps({"stages": stages, "epilogue_codecs": epilogue}))
    summary = th.read_summary(tmp_path)
    assert summary["epilogue_codecs"] == {"average": ["bf16", "fp32"], "tied": "fp32"}
    row = th.summarize(Cell(None, "fp32/fp32"), _steps(8, 0.1, 1, 1), 4, 8, summary)
    assert row["epilogue_codecs"] == summary["epilogue_codecs"] and row["reduce_bytes_per_step"] == 0


def test_a_link_setting_plans_every_links_codecs_and_its_row_names_them(tmp_path):
    from swarm.daemon.peer_config import peer_flags

    cfg = ThrottledConfig(settings=("fp32/fp32", th.DEFAULT_CODECS, f"{th.DEFAULT_CODECS}@link"))
    plain, per_link = (th.peer_config(Cell(100.0, s), cfg) for s in cfg.settings[1:])
    assert plain.planning.codec_policy == "fixed" and per_link.planning.codec_policy == "per-link"
    plain_argv, argv = peer_flags().to_argv(plain), peer_flags().to_argv(per_link)
    assert plain_argv[plain_argv.index("--codec-policy") + 1] == "fixed" and "--codec-policy" not in argv  # default
    (tmp_path / "summary.json").write_text(json.dumps({"predicted_step_s": 0.05}))
    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["a"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["b"]},
    ]
    codecs = [{"forward": "acsgd4+ch+nr", "backward": "gradq2+ef", "why": "hidden"}]
    (tmp_path / "plan.json").write_text(json.dumps({"stages": stages, "codecs": codecs}))
    summary = th.read_summary(tmp_path)
    assert summary["link_codecs"] == ["acsgd4+ch+nr/gradq2+ef"]
    row = th.summarize(Cell(100.0, f"{th.DEFAULT_CODECS}@link"), _steps(8, 0.1, 1, 1), 4, 8, summary)
    assert row["link_codecs"] == ["acsgd4+ch+nr/gradq2+ef"] and (row["fw_bits"], row["bw_bits"]) == (2, 2)


def test_a_cells_row_carries_the_machines_cpu_a_step_over_the_steps_after_the_first_epoch():
    # steps.csv rows as DictReader gives them: `time` and `machine_cpu_s` at each step's end
    steps = _steps(12, 0.1, 400_000, 400_000, 802_000, 802_000)
    for i, s in enumerate(steps):  # 0.1 s apart; the first epoch burns 1 CPU-s a step, later steps 0.15
        late = i > 7  # a held-out evaluation after step 8 took 0.5 s and 0.9 CPU-s
        s["time"] = str(1000.0 + 0.1 * i + 0.5 * late)
        s["machine_cpu_s"] = str(50.0 + (i if i < 4 else 3 + 0.15 * (i - 3)) + 0.9 * late)
    steps[7]["held_out_loss"] = "2.4"
    row = th.summarize(Cell(1000.0, "fp32/fp32"), steps, 4, 8, {})
    assert row["cpu_ms_per_step"] == pytest.approx(150.0), "the first epoch and the evaluation are not counted"
    assert row["busy_cores"] == pytest.approx(1.5)
    assert row["wall_s_per_step"] == pytest.approx(0.1)
    cores = row["cores"]
    assert cores >= 1 and row["cpu_floor_step_s"] == pytest.approx(0.15 / cores)
    rows = [row]
    th.add_comparisons(rows)
    text = thr.report_markdown(rows, {})
    assert "## The machine's CPU a step (measured)" in text
    assert f"| 100 | 100 | 150 | 1.50 | {cores} | {150 / cores:.0f} | {0.15 / cores / 0.1:.0%} |" in text


def test_rows_without_cpu_readings_carry_none_and_the_report_has_no_cpu_section():
    steps = _steps(12, 0.1, 400_000, 400_000, 802_000, 802_000)
    for s in steps[5:]:  # one reading after the first epoch is not a difference; an empty cell is no reading
        s["time"], s["machine_cpu_s"] = "1000.5", ""
    steps[6]["machine_cpu_s"] = "70.0"
    rows = [th.summarize(Cell(1000.0, "fp32/fp32"), steps, 4, 8, {})]
    th.add_comparisons(rows)
    assert "cpu_ms_per_step" not in rows[0] and "## The machine's CPU" not in thr.report_markdown(rows, {})


def test_machine_cpu_reads_a_growing_busy_count_and_the_torch_rows_carry_it():
    from swarm.experiments.torch_baseline import summarize_torch
    from swarm.train.steplog import machine_cpu, machine_cpu_s

    first = machine_cpu_s()
    assert first is not None and first > 0
    sum(i * i for i in range(2_000_000))  # CPU this process spends is the machine's too
    assert machine_cpu_s() > first
    assert machine_cpu([{"time": 5.0, "machine_cpu_s": 1.0}, {"time": 5.0, "machine_cpu_s": 2.0}]) == {}, (
        "no time between them: no rate"
    )
    gap = [{"time": 1.0, "machine_cpu_s": 1.0}, {"time": "", "machine_cpu_s": ""}, {"time": 3.0, "machine_cpu_s": 3.0}]
    assert machine_cpu(gap) == {}, "no two consecutive readings"
    records = [
        {"step": i + 1, "step_s": 0.05, "loss": 2.0, "lr": 1e-3, "schedule_s": 0.04, "sync_s": 0.005,
         "forward_bytes": 10, "backward_bytes": 10, "tied_bytes": 4, "control_bytes": 8,
         "time": 100.0 + 0.05 * i, "machine_cpu_s": 10.0 + 0.08 * i}
        for i in range(8)
    ]  # fmt: skip
    row = summarize_torch(1000.0, records, 4, 8)
    assert row["cpu_ms_per_step"] == pytest.approx(80.0) and row["busy_cores"] == pytest.approx(1.6)


def test_the_targets_against_torch_are_judged_per_rate_and_name_the_cpu_floor():
    d = th.TARGET_SETTING
    rows = [
        {"setting": "fp32/fp32", "rate_mbit": 100.0, "mean_step_s": 0.146, "cpu_floor_step_s": 0.096},
        {"setting": "fp32/fp32", "rate_mbit": 1000.0, "mean_step_s": 0.123, "cpu_floor_step_s": 0.092},
        {"setting": "fp32/fp32", "rate_mbit": 10.0, "mean_step_s": 0.9},
        {"setting": d, "rate_mbit": 100.0, "mean_step_s": 0.118},
        {"setting": d, "rate_mbit": 1000.0, "mean_step_s": 0.140},  # above 100 Mbit/s: not a target
        {"setting": d, "rate_mbit": 10.0, "mean_step_s": 0.95},
        {"setting": "torch-fp32", "rate_mbit": 100.0, "mean_step_s": 0.125},
        {"setting": "torch-fp32", "rate_mbit": 1000.0, "mean_step_s": 0.062},
        {"setting": "torch-fp32", "rate_mbit": 10.0, "mean_step_s": 0.95},
    ]
    judged = th.torch_targets(rows)
    assert [met for _, met in judged] == [False, False, True, True, False]
    assert judged[1][0] == (
        "fp32/fp32 no slower than torch-fp32 at 1000 Mbit/s: 0.123 against 0.062 s a step (1.98x); its CPU floor "
        "here 0.092 s"
    )
    assert judged[2][0].endswith("(0.95x)"), "no floor measured: none named"
    assert judged[3][0].startswith(f"{d} faster than torch-fp32 at 100 Mbit/s") and judged[3][1] is True
    assert judged[4][1] is False, "as fast is not faster"
    assert th.torch_targets([r for r in rows if r["setting"] != "torch-fp32"]) == [], "no baseline: nothing judged"
    assert th.check_targets(rows)[-5:] == judged
