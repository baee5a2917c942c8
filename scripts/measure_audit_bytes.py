"""Bytes of one audit under each record encoding, on the churn experiment's shapes, in one process.

A LocalPipeline of the churn experiment's model (the built-in GPT: hidden 128, 128 tokens, 4 layers) over 3 stages
x 2 replicas with the default codecs trains a few steps with every micro-batch audited (`--verify-fraction` 1),
once per encoding of the records (fp32, fp16, sketch relayed through the trainer, sketch with the inputs fetched
by the sibling from the audited stage: the default, `VerifyConfig.direct`). Prints per encoding the audits' bytes
(their Audit and Recompute calls, request and reply, as the driver counts them, and the siblings' AuditInputs
fetches), per audit, against fp32's, and the verifier's figures: escalations (compact audits asked again in fp32;
an honest run should have none), the worst own and link errors an audit passed.

Usage: python scripts/measure_audit_bytes.py [STEPS] [--json]
"""

import json
import sys

import torch

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.runtime.audit_wire import RECORD_CODECS
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.verify import VerifyConfig

torch.set_num_threads(1)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
steps = int(args[0]) if args else 4
model = ModelConfig(vocab_size=256)
forward, backward = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)


def batch(step: int, n: int = 8) -> Batch:
    gen = torch.Generator().manual_seed(step)
    windows = torch.randint(0, model.vocab_size, (n, model.seq_len_tokens + 1), generator=gen)
    return Batch(torch.arange(n), windows[:, :-1], windows[:, 1:])


rows = []
for records, direct in [(r, False) for r in RECORD_CODECS] + [("sketch", True)]:
    pipe = LocalPipeline(model, 3, forward, backward, replicas=2)
    try:
        driver = pipe.driver(
            4, heartbeat_s=60.0, verify=VerifyConfig(fraction=1.0, seed=1, records=records, direct=direct)
        )
        audit_bytes = 0
        for step in range(steps):
            counters = driver.train_step(step, batch(step)).counters
            audit_bytes += sum(
                v
                for k, v in counters.items()
                if any(f'method="{m}"' in k for m in ("Audit", "Recompute", "AuditInputs"))
            )
        stats = driver.verifier.stats
        rows.append({
            "records": records + (" direct" if direct else ""), "audits": stats.audits, "audit_bytes": int(audit_bytes),
            "bytes_per_audit": int(audit_bytes / max(1, stats.audits)), "escalations": stats.escalations,
            "evicted": len(stats.detections), "disputes": stats.disputes, "worst_own": stats.worst_own,
            "worst_link": stats.worst_link, "worst_link_backward": stats.worst_link_backward,
        })  # fmt: skip
    finally:
        pipe.close()
fp32 = rows[0]["bytes_per_audit"]
for row in rows:
    row["vs_fp32"] = row["bytes_per_audit"] / fp32
if "--json" in sys.argv:
    print(json.dumps(rows, indent=1))
else:
    for r in rows:
        print(
            f"{r['records']:13s} {r['audits']} audits, {r['bytes_per_audit'] / 1e3:.1f} KB an audit "
            f"({r['vs_fp32']:.3f} of fp32's), escalations {r['escalations']}, evicted {r['evicted']}, "
            f"disputes {r['disputes']}, worst own "
            f"{r['worst_own']:.2e}, link {r['worst_link']:.3f} / {r['worst_link_backward']:.3f}"
        )
