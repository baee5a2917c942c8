"""fp16 over gRPC loopback stages equals the in-process pipeline step for step, a skip included: the loss scale,
the skip flag and the scale checks travel on the wire as they do in process."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import StageConfig
from tests.integration.swarm_fixtures import TINY, loopback_stages, remote
from tests.integration.test_stage_service import batches
from tests.unit.runtime.test_precision_pipeline import Poison

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FP32 = CodecConfig("fp32")


def test_fp16_loopback_matches_in_process_with_a_skip():
    cfg = StageConfig(precision="fp16")
    data = batches(4)
    local = LocalPipeline(TINY, 2, FP32, FP32, stage_cfg=cfg)
    with loopback_stages(2, FP32, FP32, stage_cfg=cfg) as (hosts, _, addresses):
        pipe = remote(addresses)
        poisons = [Poison(next(h.worker.module.parameters())) for h in (local.hosts[1], hosts[1])]
        got, expected = [], []
        for step, b in enumerate(data):
            for p in poisons:
                p.armed = step == 1
            expected.append(local.train_step(b, 2))
            got.append(pipe.train_step(step, b))
        pipe.close()
        assert [r.skipped for r in got] == [r.skipped for r in expected] == [False, True, False, False]
        assert [r.loss_scale for r in got] == [r.loss_scale for r in expected] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
        torch.testing.assert_close(torch.tensor([r.loss for r in got]), torch.tensor([r.loss for r in expected]))
        for host, worker in zip(hosts, local.workers, strict=True):
            assert host.worker.step_count == worker.step_count == 3
            theirs = worker.module.state_dict()
            for name, a in host.worker.module.state_dict().items():
                torch.testing.assert_close(a, theirs[name], msg=lambda m, n=name: f"{n}: {m}")
    local.close()
