"""The honest link error of forward codecs: how far what the next stage decodes is from the activation sent.

The verifier's link check (`swarm.runtime.verify.VerifyConfig.link_rtol`, 1.0) holds a stage's decoded input to
the previous stage's recomputed output within the forward codec's error; a codec whose honest error reached it would
get honest peers blamed. This trains the convergence experiment's settings in one process and records, for every
forward message of a codec with message buffers, the relative L2 error of what the receiver decodes (the sender's
buffers after the encode hold exactly that) against the activation, as the verifier's `rel_err` reads a micro-batch.

Usage: python scripts/measure_link_error.py [convergence flags...]   (e.g. --settings fp32/fp32,SETTING --epochs 8)
Prints, per setting, the number of messages and the median, 99th percentile and largest error; first sights
and deltas apart (a message holding both counts as one of each kind it holds).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch

from swarm.cli import main
from swarm.compression.codec_aqsgd import AQSGDCodec
from swarm.runtime.verify import rel_err

errors: dict[tuple[str, str], list[float]] = defaultdict(list)
_encode = AQSGDCodec._encode_body


def _measured(self, x, msg, state):
    _encode(self, x, msg, state)
    ids = list(msg.sample_ids)
    decoded = state.buffers.gather(state.buffers.lookup(ids)).to(x.device, torch.float32)
    kinds = {"delta" if d else "first" for d in msg.sample_is_delta}
    for kind in kinds:
        errors[(self.config.label, kind)].append(rel_err(x.float(), decoded.view(x.shape)))


AQSGDCodec._encode_body = _measured
code = main(["experiment", "convergence", *sys.argv[1:], "--no-progress"])
rows = []
for (label, kind), errs in sorted(errors.items()):
    e = torch.tensor(errs)
    rows.append({"codec": label, "kind": kind, "messages": len(errs), "median": round(float(e.median()), 4),
                 "p99": round(float(e.quantile(0.99)), 4), "max": round(float(e.max()), 4)})  # fmt: skip
print(json.dumps(rows, indent=1), file=sys.stderr)
sys.exit(code)
