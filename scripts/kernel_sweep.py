"""The Triton quantize kernels' launch choices, measured on one GPU: which tile, warps and store the kernels use.

    python scripts/kernel_sweep.py [--size-mib 512] [--json]    # on a CUDA machine (docs/GPU.md)
    TRITON_INTERPRET=1 python scripts/kernel_sweep.py --dry-run   # here: every configuration once, tiny, on the CPU

For each quantizer (aqsgd: min/scale; acsgd: symmetric), code width, store (whole 32-bit words or bytes), tile
(elements per program) and warp count, it times the public call (`quantize`/`sym_quantize`: allocation, kernel
and the NaN check's one device-to-host sync) and the kernel launch alone with `triton.testing.do_bench` (median,
L2 flushed between runs), as GB/s of bytes read and written (4 per float32 element, the packed codes, the scales
and mins), beside a device-to-device copy of the same tensor timed the same way. Every configuration's codes are
checked against the default one's (the same bytes whatever the launch). Prints one JSON object per line, then
the fastest configuration of each quantizer and width.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from swarm.kernels import triton_kernels as tk
from swarm.kernels import triton_sym as ts
from swarm.kernels.qtensor import num_groups

GROUP = 256


def _timer(device: str):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3

    def cpu(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu


def _kernel_launch(quantizer: str, x: torch.Tensor, bits: int, stochastic: bool):
    """The quantize kernel alone, launched as the public call launches it, on outputs allocated once."""
    if quantizer == "acsgd":
        return ts.sym_quantize_launcher(x, bits, GROUP, stochastic=stochastic)[0]
    return tk.quantize_launcher(x, bits, GROUP, stochastic=stochastic)[0]


def _call(quantizer: str, x: torch.Tensor, bits: int, stochastic: bool):
    if quantizer == "acsgd":
        return lambda: ts.sym_quantize(x, bits, GROUP, stochastic=stochastic, seed=0)
    return lambda: tk.quantize(x, bits, GROUP, stochastic=stochastic, seed=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="float32 tensor size (several times the L2)")
    parser.add_argument("--dry-run", action="store_true", help="tiny, on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tiles", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("kernel_sweep: CUDA is not available (--dry-run runs it on the CPU)", file=sys.stderr)
        return 2
    numel = (4 * 8192 + 300) if args.dry_run else (args.size_mib << 20) // 4
    x = torch.randn(numel, device=device, generator=torch.Generator(device).manual_seed(0))
    timed = _timer(device)
    copy_to = torch.empty_like(x)
    copy_gbps = 8 * numel / timed(lambda: copy_to.copy_(x)) / 1e9
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({"device": name, "numel": numel, "copy_gbps": round(copy_gbps, 1)}), flush=True)
    defaults = (tk._QUANTIZE_TILE_ELEMENTS, tk._NUM_WARPS, tk._WORD_STORES)
    best: dict[tuple, dict] = {}
    for quantizer, bits in itertools.product(("aqsgd", "acsgd"), args.bits):
        tk._QUANTIZE_TILE_ELEMENTS, tk._NUM_WARPS, tk._WORD_STORES = defaults
        want = _call(quantizer, x, bits, False)()
        groups = num_groups(numel, GROUP)
        moved = 4 * numel + (numel * bits + 7) // 8 + groups * (2 if quantizer == "acsgd" else 8)
        for stochastic, words, tile, warps in itertools.product((True, False), (True, False), args.tiles, args.warps):
            if not stochastic and (tile, warps) != (args.tiles[0], args.warps[0]) and not words:
                continue  # nearest rounding: every tile and warp count with word stores, and one with byte stores
            tk._QUANTIZE_TILE_ELEMENTS, tk._NUM_WARPS, tk._WORD_STORES = tile, warps, words
            got = _call(quantizer, x, bits, False)()
            same = torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)
            row = {"quantizer": quantizer, "bits": bits, "stochastic": stochastic, "words": words, "tile": tile,
                   "warps": warps, "same_codes": same}  # fmt: skip
            for what, fn in (("call", _call(quantizer, x, bits, stochastic)),
                             ("kernel", _kernel_launch(quantizer, x, bits, stochastic))):  # fmt: skip
                gbps = moved / timed(fn) / 1e9
                row[f"{what}_gbps"], row[f"{what}_of_copy"] = round(gbps, 3), round(gbps / copy_gbps, 3)
            print(json.dumps(row), flush=True)
            key = (quantizer, bits, stochastic)
            if same and row["kernel_gbps"] > best.get(key, {"kernel_gbps": 0})["kernel_gbps"]:
                best[key] = row
    tk._QUANTIZE_TILE_ELEMENTS, tk._NUM_WARPS, tk._WORD_STORES = defaults
    print("fastest (kernel alone):")
    for row in best.values():
        print(json.dumps(row | {"best": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
