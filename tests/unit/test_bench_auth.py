"""`swarm bench auth`'s per-call part runs and its rows say what they measured (no timing asserted)."""

from __future__ import annotations

from swarm.bench.auth import per_call_rows, summary_row


def test_per_call_rows_time_the_token_alone_and_each_proof_and_the_summary_derives_the_share():
    rows = per_call_rows(3)
    assert [r["call"] for r in rows][0] == "token only (before call proofs)"
    assert [r["fields_bytes"] > 1 << 20 for r in rows] == [False, False, False, True]
    assert all(r["sign_us"] > 0 and r["verify_us"] > 0 for r in rows)
    local = [
        {"part": "local", "auth": True, "mean_step_s": 0.2, "calls_per_step": 10},
        {"part": "local", "auth": False, "mean_step_s": 0.1, "calls_per_step": 0},
    ]
    summary = summary_row(rows, local, [])
    extra = rows[1]["sign_us"] + rows[1]["verify_us"] - rows[0]["sign_us"] - rows[0]["verify_us"]
    assert summary["proof_extra_us_per_unary_call"] == extra and summary["local_ratio"] == 2.0
    assert summary["local_proof_share_of_step"] == extra * 1e-6 * 10 / 0.2 and "ratio" not in summary
