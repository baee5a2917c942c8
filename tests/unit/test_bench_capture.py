"""The codec benches' real messages (`swarm bench codecs --deltas model`, `--first-sights model`): one capture loop
trains the convergence model in process and takes what each bench asks of every buffered forward message."""

from __future__ import annotations

import torch

from swarm.bench.codec_deltas import capture_forward_messages, model_deltas


def test_deltas_exist_only_from_a_samples_second_visit_and_the_pick_sees_every_captured_message():
    # 128 samples, 8 steps a pass: one pass has no sample coming back; a second pass brings every one back
    assert model_deltas(epochs=1, every=1, say=lambda _: None, train_samples=128) == []
    assert model_deltas(epochs=2, every=1, say=lambda _: None, train_samples=128)
    seen: list[tuple[int, ...]] = []

    def pick(x, msg, state):
        seen.append(tuple(x.shape))
        return x.detach().float().clone() if len(seen) % 2 else None  # None: nothing taken

    lines: list[str] = []
    got = capture_forward_messages(
        "aqsgd2/gradq4+ef", pick, epochs=1, every=2, what="acts", say=lines.append, train_samples=128
    )
    assert seen and len(got) == (len(seen) + 1) // 2 and all(isinstance(t, torch.Tensor) for t in got)
    assert lines == [lines[0]] and f"{len(got)} acts" in lines[0]
