"""What a thread keeps once it has computed: the soak's model's stage 0 forward and backward (bf16 autocast by
default), malloc's in-use bytes (`mallinfo2`) on one thread over many passes, then per new thread that computes once
and stays alive (a pool's idle thread), then after those threads ended. Run it with a peer's settings
(`GLIBC_TUNABLES=glibc.malloc.tcache_count=0 MKL_DISABLE_FAST_MM=1 MALLOC_ARENA_MAX=2`). A figure for
docs/reports/footprint.md (why a gRPC server hands calls to its hot threads, `swarm.peers.hotpool`), not a test.

    python scripts/measure_thread_caches.py [bf16|fp32] [--threads 50]
"""

from __future__ import annotations

import argparse
import threading

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("precision", nargs="?", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=50, help="new threads, each computing once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from swarm.bench.soak import MODEL
    from swarm.daemon.heapstats import mallinfo
    from swarm.daemon.lean import skip_dynamo
    from swarm.model.spec import build_stage
    from swarm.runtime.precision import autocast

    skip_dynamo()
    model = MODEL.build()
    stage = build_stage(model, 0, 1, True, False)

    def one() -> None:
        x = torch.randint(0, model.vocab_size, (2, model.seq_len_tokens))
        with autocast(args.precision):
            out = stage(x)
        (out.float() * torch.randn(out.shape)).sum().backward()

    def in_use_mib() -> float:
        return mallinfo().in_use_bytes / 2**20

    for _ in range(50):
        one()
    before = in_use_mib()
    for _ in range(200):
        one()
    print(f"{args.precision}: one thread, 200 more passes: {in_use_mib() - before:+.3f} MiB in use")
    stop, ready = threading.Event(), threading.Semaphore(0)

    def computes_once_and_stays() -> None:
        one()
        ready.release()
        stop.wait()

    before = in_use_mib()
    threads = [threading.Thread(target=computes_once_and_stays) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire(timeout=300)
    kib = (in_use_mib() - before) * 1024 / args.threads
    print(f"{args.precision}: {args.threads} threads alive, each after one pass: {kib:+.1f} KiB in use per thread")
    stop.set()
    for t in threads:
        t.join()
    kib = (in_use_mib() - before) * 1024 / args.threads
    print(f"{args.precision}: once they ended: {kib:+.1f} KiB per thread")


if __name__ == "__main__":
    main()
