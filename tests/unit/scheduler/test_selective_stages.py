"""Selective stage compression: an epilogue exchange hidden behind the slowest one is widened, never the epilogue."""

import random

import pytest

from swarm.peers.plan_codecs import EpilogueCodecs
from swarm.scheduler.bits import (
    AVERAGE_LADDER,
    TIED_LADDER,
    BitsPolicy,
    CodecSpeed,
    EpilogueFigures,
    choose_epilogue,
)
from swarm.scheduler.selective_stages import epilogue_length_s, widen_hidden

FLOOR, TIED_FLOOR = AVERAGE_LADDER[-1], TIED_LADDER[-1]
MB = 1e6 / 8


def _fig(mbit: float, elements: float = 1e6, step_s: float = 1.0) -> EpilogueFigures:
    return EpilogueFigures(mbit * MB, elements, step_s)


def test_equal_stages_keep_their_floors():
    figs = [_fig(10), _fig(10), _fig(10)]
    chosen = choose_epilogue(figs, None, BitsPolicy())
    assert chosen.average_labels == (FLOOR,) * 3
    assert widen_hidden(chosen, figs, None) == chosen


def test_a_stage_hidden_behind_a_slower_one_is_summed_wider():
    figs = [_fig(100), _fig(1), _fig(100)]  # stage 1's replicas sit behind a slow link: it sets the epilogue
    chosen = choose_epilogue(figs, None, BitsPolicy())
    assert chosen.average_labels == (FLOOR,) * 3
    widened = widen_hidden(chosen, figs, None)
    assert widened.average_labels == ("fp32", FLOOR, "fp32")  # 32 bits at 100 Mbit/s < 8 bits at 1 Mbit/s
    assert epilogue_length_s(widened.average_labels, None, figs, None) <= epilogue_length_s(
        chosen.average_labels, None, figs, None
    )
    assert "widened" in widened.why


def test_the_tied_sync_runs_after_the_end_stages_sums():
    figs = [_fig(10), _fig(1), _fig(10)]
    tied = _fig(10, elements=5e5)
    chosen = choose_epilogue(figs, tied, BitsPolicy())
    widened = widen_hidden(chosen, figs, tied)
    # the end stages' sum plus the tied sync must still end before stage 1's sum
    length = epilogue_length_s(widened.average_labels, widened.tied_label, figs, tied)
    assert length <= epilogue_length_s(chosen.average_labels, chosen.tied_label, figs, tied) * (1 + 1e-9)
    assert widened.average_labels[1] == FLOOR
    assert TIED_LADDER.index(widened.tied_label) < TIED_LADDER.index(TIED_FLOOR)


def test_widening_never_lengthens_the_epilogue_nor_narrows_a_codec():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 5)
        figs = [None if rng.random() < 0.3 else _fig(rng.choice([1, 10, 100, 1000])) for _ in range(n)]
        tied = _fig(rng.choice([1, 10, 100])) if n > 1 and rng.random() < 0.7 else None
        chosen = choose_epilogue(figs, tied, BitsPolicy())
        widened = widen_hidden(chosen, figs, tied)
        before = epilogue_length_s(chosen.average_labels, chosen.tied_label, figs, tied)
        assert epilogue_length_s(widened.average_labels, widened.tied_label, figs, tied) <= before * (1 + 1e-9)
        for a, b in zip(chosen.average_labels, widened.average_labels, strict=True):
            assert (a is None) == (b is None)
            assert a is None or AVERAGE_LADDER.index(b) <= AVERAGE_LADDER.index(a)
        if chosen.tied_label is not None:
            assert TIED_LADDER.index(widened.tied_label) <= TIED_LADDER.index(chosen.tied_label)


def test_nothing_to_sum_is_left_alone():
    chosen = EpilogueCodecs((None, None), None, "x")
    assert widen_hidden(chosen, [None, None], None) is chosen


# ---- measured codec speed: an exchange is its bytes and its encoding --------------------------------------------

# per element: fp32 and bf16 nearly free, the quantized rungs ~30x dearer (s44 on this machine: fp32 7 ns an element
# to encode, 2 ns to decode; the 2-bit sum 24 and 9 ns)
SPEED = CodecSpeed(
    (("fp32", 7e-9, 2e-9), ("bf16", 5e-9, 3e-9), (AVERAGE_LADDER[2], 40e-9, 9e-9), (FLOOR, 24e-9, 9e-9),
     (TIED_FLOOR, 26e-9, 8e-9))
)  # fmt: skip


def _timed(mbit: float, elements: float = 1.5e6, step_s: float = 0.12) -> EpilogueFigures:
    return EpilogueFigures(mbit * MB, elements, step_s, 2, SPEED)


def test_on_a_fast_link_the_sum_whose_encoding_costs_more_than_its_bytes_save_is_sent_wide():
    # unshaped loopback here: ~70 MB/s of gRPC. No codec fits 5% of a 0.12 s step, so bytes alone give the floor;
    # with the codecs' speed the floor's sum takes 68 ms (5 on the wire), fp32's 102 (86), bf16's 59 (43): bf16
    fast = _timed(560)
    chosen = choose_epilogue([fast, fast], None)
    by_bytes = choose_epilogue([EpilogueFigures(560 * MB, 1.5e6, 0.12)] * 2, None)
    assert by_bytes.average_labels == (FLOOR, FLOOR)
    quickest = min(AVERAGE_LADDER, key=fast.seconds)
    assert chosen.average_labels == (quickest, quickest) and quickest != FLOOR
    assert fast.seconds(quickest) < fast.seconds(FLOOR)


def test_on_a_slow_link_the_bytes_decide_and_the_floor_stays():
    slow = _timed(1)
    assert choose_epilogue([slow], None).average_labels == (FLOOR,)
    assert slow.seconds(FLOOR) < slow.seconds("bf16") / 5


def test_a_codec_not_measured_costs_its_bytes_alone_and_the_time_counts_every_member_s_decode():
    assert SPEED.seconds_per_element("gtern", 4) == 0.0
    assert SPEED.seconds_per_element(FLOOR, 4) - SPEED.seconds_per_element(FLOOR, 2) == pytest.approx(2 * 9e-9)
    four = EpilogueFigures(560 * MB, 1e6, 0.1, 4, SPEED)
    assert four.seconds(FLOOR) > _timed(560, 1e6, 0.1).seconds(FLOOR)


def test_the_measured_speed_covers_each_codec_once_with_positive_finite_figures():
    import math

    from swarm.scheduler.sizes import measure_codec_speed

    speed = measure_codec_speed(("fp32", FLOOR, "fp32"), elements=1 << 12, repeats=1)
    assert [label for label, *_ in speed.per_element] == ["fp32", FLOOR]
    assert all(math.isfinite(e) and e > 0 and math.isfinite(d) and d > 0 for _, e, d in speed.per_element)


def test_where_a_wide_codec_is_within_the_share_of_the_quickest_the_precise_one_wins():
    # s44's second unshaped cell: stage 0's replicas probed at 325 Mbit/s, 264k elements. The 2-bit sum is the
    # quickest by 3 ms, less than 5% of the 0.107 s step: bf16 (measured in the swarm: 70-74 ms a step's sums
    # against 2-bit's 97-107) is chosen
    fig = EpilogueFigures(325 * MB, 264e3, 0.107, 2, SPEED)
    assert fig.seconds(FLOOR) < fig.seconds("bf16") < fig.seconds(FLOOR) + 0.05 * 0.107 < fig.seconds("fp32")
    assert choose_epilogue([fig], None).average_labels == ("bf16",)
    # without the speed the floor's bytes are far the quickest: it stays
    assert choose_epilogue([EpilogueFigures(325 * MB, 264e3, 0.107)], None).average_labels[0] != "bf16"
