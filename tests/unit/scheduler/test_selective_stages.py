"""Selective stage compression: an epilogue exchange hidden behind the slowest one is widened, never the epilogue."""

import random

from swarm.peers.plan_codecs import EpilogueCodecs
from swarm.scheduler.bits import AVERAGE_LADDER, TIED_LADDER, BitsPolicy, EpilogueFigures, choose_epilogue
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
