"""The delta study of `swarm bench codecs --deltas`: its packing matches the kernels', the AQ-SGD paper's
compressor as written is within its half step, and the synthetic study runs and ranks the layouts."""

from __future__ import annotations

import numpy as np
import torch

from swarm.bench import codec_deltas as cd
from swarm.kernels import quantize


def test_code_packing_matches_the_kernels_bitstream():
    x = torch.randn(1000)
    for bits in (2, 4, 8):
        q = quantize(x, bits, 64, stochastic=False)
        codes = cd.unpack_codes(q.packed.numpy().tobytes(), bits, x.numel())
        assert cd.pack_codes(codes, bits) == q.packed.numpy().tobytes()
        assert codes.max() < 2**bits


def test_the_papers_compressor_is_within_half_a_step_of_each_channel():
    d = torch.randn(3, 32, 16)
    for bits in (2, 4):
        codes, scale = cd.paper_quantize(d, bits)
        assert scale.dtype == torch.float16 and scale.shape == (3, 1, 16)
        y = cd.paper_dequantize(codes, scale, bits)
        step = scale.float() / 2 ** (bits - 1)
        # round to nearest, except the top code, which clips: the paper's grid stops one step below +scale
        inside = d < scale.float() - step
        assert ((y - d).abs()[inside] <= (step / 2 * 1.01).expand_as(d)[inside] + 1e-3).all()
        assert ((y - d).abs() <= step * 1.01 + 1e-3).all()


def test_entropy_of_uniform_and_constant_codes():
    assert cd.entropy_bits(np.zeros(100, np.uint8), 2) == 0.0
    assert abs(cd.entropy_bits(np.arange(400, dtype=np.uint8) % 4, 2) - 2.0) < 1e-9


def test_synthetic_study_ranks_channel_groups_above_flat_on_outlier_channels():
    rows = cd.delta_rows({"synthetic": cd.synthetic_deltas(n=1, shape=(2, 64, 64))}, bits_list=(2,))
    by = {r["scheme"]: r for r in rows}
    assert set(by) == set(cd.SCHEMES)
    assert by["ours-channel-nr"]["rel_error"] < by["ours-flat-nr"]["rel_error"] / 2
    assert by["paper"]["payload_scales_bytes_per_element"] < by["ours-channel-nr"]["payload_scales_bytes_per_element"]
    for r in rows:
        assert 0 < r["code_entropy_bits"] <= 2 and r["rel_error"] > 0
