"""What a peer's thread pool leaves on the heap: a toy block's forward+backward on N pool threads, with the peer's
allocator settings (`tune_allocator`, 2 arenas, no dynamo), anonymous memory after each round of 4N passes;
`--trim` calls malloc_trim(0) after each round (what a peer's periodic trimmer did until real peers showed it
changed nothing), `--serial` runs one pass at a time. Run it with `MKL_DISABLE_FAST_MM=1` in the environment for
what a peer does now (`swarm.daemon.lean.no_mkl_buffer_pools`). A figure for docs/reports/footprint.md, not a test.

    python scripts/measure_heap_retention.py --workers 1
    python scripts/measure_heap_retention.py --workers 32 [--trim] [--serial]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def anon_mb() -> float:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=32, help="pool threads")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of 4 x workers passes")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each round")
    parser.add_argument("--serial", action="store_true", help="one pass at a time (a lock around each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from swarm.daemon.lean import cap_arenas, skip_dynamo
    from swarm.model.spec import build_stage
    from swarm.options import ModelFlags
    from swarm.peers.allocator import tune_allocator

    tune_allocator(), cap_arenas(), skip_dynamo()
    model = ModelFlags().build()
    block = build_stage(model, 0, 1, False, False)
    lock = threading.Lock() if args.serial else None

    def one(_: int) -> None:
        x = torch.randn(2, model.seq_len_tokens, model.hidden_dim, requires_grad=True)
        out = block(x)
        (out * torch.randn_like(out)).sum().backward()

    def call(i: int) -> None:
        if lock is None:
            return one(i)
        with lock:
            return one(i)

    pool = ThreadPoolExecutor(args.workers)
    ready = threading.Barrier(args.workers)
    list(pool.map(lambda _: ready.wait(), range(args.workers)))  # every thread started before the first figure
    print(f"workers {args.workers}: start {anon_mb():.1f} MiB anonymous")
    for n in range(args.rounds):
        list(pool.map(call, range(4 * args.workers)))
        if args.trim:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        print(f"  round {n}: {anon_mb():.1f} MiB anonymous")


if __name__ == "__main__":
    main()
