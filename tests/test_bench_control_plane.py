"""The control-plane benchmark: a short real run (coordinator, gRPC, rank service, no-op forward), and that the
no-op engine stays a benchmark mode that no serving command can reach."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lockstep.bench.control_plane import ControlPlaneConfig, is_full_decode, run_all
from lockstep.bench.control_plane_cli import configs, parse_args
from lockstep.bench.control_plane_report import PARTS, format_table, step_parts, summarize
from lockstep.coordinator.events import Event, EventKind

BATCH, STEPS, WARMUP = 4, 20, 2


@pytest.mark.parametrize("overlap, frontends", [(False, False), (True, False), (True, True)])
def test_a_short_run_goes_through_the_real_scheduler_grpc_and_rank_service(tmp_path, overlap, frontends):
    """With `frontends`, the tokens leave through an API frontend's link (one message per step) and the clients
    count them from its columns."""
    cfg = ControlPlaneConfig(batch=BATCH, tp=1, steps=STEPS, warmup=WARMUP, min_prompt=5, max_prompt=40,
                             overlap=overlap, frontends=frontends)
    pinned = (max(os.sched_getaffinity(0)),) if overlap and not frontends else ()  # as --split-cores runs the ranks
    runs, profiler = run_all([cfg], tmp_path, rank_cpus=pinned)
    assert profiler is None
    raw = runs[0]
    assert raw.rank_stats[0]["cpus"] == list(pinned or sorted(os.sched_getaffinity(0)))
    # every request ended by max_tokens, its client got every token, and the ranks hold nothing afterwards
    assert raw.tokens == [cfg.max_tokens] * BATCH
    assert raw.finish_reasons == ["length"] * BATCH
    assert raw.final_used_pages == [0]
    [rank] = raw.rank_stats
    assert rank["exit"] == 0 and rank["consistent"] is True and rank["requests_held"] == 0
    assert [p["used"] for p in rank["pools"]] == [0]
    # the rank deserialized and answered exactly the plans the coordinator's step loop sent, step for step
    steps = sorted({r.step for reports in raw.reports for r in reports})
    assert len(steps) == len(raw.timings) == len(raw.reports)
    assert sorted(int(s) for s in rank["plan_s"]) == steps and sorted(int(s) for s in rank["report_s"]) == steps
    # the scheduler batched every request in each steady step, one decode token each
    steady = [t for t, s in zip(raw.timings, raw.steady, strict=True) if s]
    assert len(steady) >= WARMUP + STEPS and all(t.batch == BATCH for t in steady)
    row = summarize(raw)
    assert row["measured_steps"] == STEPS and row["completed"] == BATCH
    # with overlap every steady plan is built while the ranks run the step before, and so is every apply hidden
    built_now = ("ahead",) if overlap else ("plan", "serialize")
    for part in (*built_now, "round_trip", "rank_apply", "rank_engine", "apply", "deliver", "total"):
        assert row["ms"][part]["p50"] > 0, part
    if overlap:
        assert row["ms"]["plan"]["p90"] == row["ms"]["exposed"]["p90"] == 0
    parts = step_parts(raw)
    assert all(gap > 0 for gap in parts["rank_gap"])  # each rank sent a report, then read the next plan
    if not overlap:  # all of the coordinator's time is exposed but the tokens' delivery, done once the next plan is out
        assert row["ms"]["ahead"]["p90"] == 0
        assert parts["coordinator"] == pytest.approx([e + d + k for e, d, k in zip(
            parts["exposed"], parts["deliver"], parts["link"], strict=True)])
        # a plan built from the reports of the step before cannot reach a rank before it was built and queued
        assert all(gap >= p + q for gap, p, q in zip(parts["rank_gap"], parts["plan"], parts["serialize"], strict=True))
    assert row["ms"]["rank_engine"]["p50"] <= row["ms"]["rank_apply"]["p50"]
    if not overlap:  # with overlap the ranks start a plan sent ahead before its round trip is timed (transport < 0)
        assert row["ms"]["rank_apply"]["p50"] <= row["ms"]["round_trip"]["p50"]
    # a steady step's link message: built and encoded once per step, only with frontends, and counted as the
    # coordinator's own time
    assert (row["ms"]["link"]["p50"] > 0) == frontends and (row["ms"]["link"]["p90"] == 0) == (not frontends)
    if frontends:
        assert len(raw.link_s) >= WARMUP + STEPS
    table = format_table([row])
    assert "p50, ms" in table and "p90, ms" in table and "TensorRT-LLM" in table and "update_from_output" in table
    assert "WARNING" not in table


def test_serving_commands_have_no_way_to_the_noop_engine(capsys):
    from lockstep.rank.main import parse_args as rank_args
    from lockstep.serve import parse_args as serve_args

    for parse in (rank_args, serve_args):
        with pytest.raises(SystemExit):
            parse(["--help"])
        text = capsys.readouterr().out.lower()
        assert "noop" not in text and "no-op" not in text and "control-plane" not in text
        for flag in ("--noop", "--noop-forward", "--control-plane"):
            with pytest.raises(SystemExit):
                parse([flag])
            capsys.readouterr()
    # nothing a serving process imports loads the benchmark's engine
    code = ("import sys, lockstep.cli, lockstep.serve, lockstep.rank.main, lockstep.coordinator.main; "
            "bad = [m for m in sys.modules if m.startswith('lockstep.bench')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_line_runs_each_tp_agreement_and_batch_once():
    args = parse_args(["--batch", "8,64", "--tp", "1,2", "--agreement", "both", "--steps", "5", "--overlap", "on"])
    got = [(c.tp, c.agreement, c.batch, c.steps) for c in configs(args)]
    assert got == [(1, True, 8, 5), (1, True, 64, 5), (2, True, 8, 5), (2, True, 64, 5), (2, False, 8, 5),
                   (2, False, 64, 5)]
    both = [(c.overlap, c.batch) for c in configs(parse_args(["--batch", "8", "--tp", "1"]))]
    assert both == [(True, 8), (False, 8)]
    linked = [(c.frontends, c.batch) for c in configs(parse_args(["--batch", "8", "--tp", "1", "--overlap", "on",
                                                                  "--frontends", "both"]))]
    assert linked == [(True, 8), (False, 8)]
    with pytest.raises(SystemExit):
        parse_args(["--batch", "8,0"])
    with pytest.raises(SystemExit):
        parse_args(["--min-prompt", "70", "--max-prompt", "10"])
    assert {c.forward_ms for c in configs(parse_args(["--batch", "8,64", "--forward-ms", "2.5"]))} == {2.5}
    ahead = [c.prepare_ahead for c in configs(parse_args(["--batch", "8", "--tp", "1", "--overlap", "on",
                                                          "--forward-ms", "2", "--prepare-ahead", "both"]))]
    assert ahead == [True, False]
    assert all(c.prepare_ahead for c in configs(parse_args(["--batch", "8", "--prepare-ahead", "off"])))  # no forward
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_args(["--forward-ms", bad])


def test_a_forward_that_takes_time_leaves_the_ranks_no_wait_for_the_coordinator(tmp_path):
    """`--forward-ms`: the ranks' forward takes that long (a sleep, as a host waits on its GPU). With overlap the
    next plan is there before a step ends, so between two steps a rank only sends its report (on its own thread,
    while the next step runs) and reads the plan: the coordinator's time is all behind the forward."""
    cfg = ControlPlaneConfig(batch=BATCH, tp=1, steps=STEPS, warmup=WARMUP, min_prompt=5, max_prompt=40,
                             forward_ms=20.0)
    runs, _ = run_all([cfg], tmp_path)
    row = summarize(runs[0])
    assert row["completed"] == BATCH and row["measured_steps"] == STEPS
    assert row["ms"]["rank_engine"]["p50"] >= 20.0 and row["ms"]["total"]["p50"] >= 20.0
    assert row["ms"]["rank_gap"]["p50"] < 5.0 and row["ms"]["exposed"]["p90"] == 0
    assert "fwd 20" in format_table([row])
    # the ranks prepared step k + 1 while their forward of step k ran: plan k + 1 had arrived by then
    assert row["prepare_ahead"] and row["prepared_ahead"] >= 0.9


def test_without_preparing_ahead_no_step_is_staged(tmp_path):
    cfg = ControlPlaneConfig(batch=8, tp=1, steps=5, warmup=2, min_prompt=5, max_prompt=20, forward_ms=5.0,
                             prepare_ahead=False)
    runs, _ = run_all([cfg], tmp_path)
    row = summarize(runs[0])
    assert row["completed"] == 8 and row["prepared_ahead"] == 0 and runs[0].rank_stats[0]["staged"] == []
    assert "fwd 5 sync" in format_table([row])


def test_the_window_holds_enough_steady_steps_and_every_context():
    cfg = ControlPlaneConfig(batch=256, steps=200, warmup=10, max_prompt=64, max_num_batched_tokens=2048)
    prefill_steps = -(-256 * 64 // (2048 - 256))
    assert cfg.max_tokens >= cfg.warmup + cfg.steps + prefill_steps
    assert cfg.max_model_len >= cfg.max_prompt + cfg.max_tokens
    assert cfg.kv_pages >= cfg.batch * -(-cfg.max_model_len // cfg.page_size)
    with pytest.raises(ValueError):
        ControlPlaneConfig(batch=0)


def test_a_full_decode_step_is_a_token_for_every_request_and_no_finish():
    tokens = [Event(f"r{i}", EventKind.TOKEN, 5) for i in range(3)]
    assert is_full_decode(tokens, 3)
    assert not is_full_decode(tokens[:2], 3)
    assert not is_full_decode([*tokens, Event("r0", EventKind.FINISHED)], 3)
    assert set(PARTS) >= {"plan", "serialize", "round_trip", "rank_apply", "apply", "total"}
