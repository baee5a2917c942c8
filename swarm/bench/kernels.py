"""`swarm bench kernels`: quantize/dequantize/AQ-SGD GB/s beside a torch memory copy, and the error they cost.

Speeds are GB/s of float32 input (4 bytes per element) so every column compares with the copy of the same
tensor (`dst.copy_(src)`, preallocated destination) timed in the same run. `dequantize` allocates its output,
so for large tensors it pays the page faults of fresh memory that the copy does not; `dequantize_into` writes
a preallocated tensor (`out=`), like the copy. `aqsgd_update` reads float32 activations and updates a float16
buffer in place.
`--quantizer acsgd` times the symmetric quantizer of the acsgd codec (fp16 scale per group) instead.
`--encodings` instead prints the measurement behind the choice of scale dtype and group size.

`--device cuda[:N]` times the Triton kernels of both quantizers on the GPU at 2/4/8 bits, rounding to nearest (what
the default codecs do: `+nr`) and stochastically (`--nearest` is the CPU table's), on a tensor of the largest
`--sizes-kib` (64 MiB by default; make it several times the L2 cache, which is 50-60 MB on a Hopper) (CUDA events,
after warm-up): GB/s of the bytes each kernel actually reads and writes, its share of the device's memory
bandwidth measured in the same run as a device-to-device copy (8 bytes moved per float32 element), and its share
of the memory's nominal peak (`--hbm-peak-gbps`, else the datasheet figure of a known device: `hbm_peak_gbps`).
`quantize` times the public call (allocation, kernel and the NaN check, whose device-to-host sync leaves the GPU
idle while the next call is prepared), `quantize_kernel` the same kernel launched alone on outputs allocated once.
The update's fp16 buffer counts 2 bytes read and 2 written per element.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch

from swarm.flags import Flags, flag
from swarm.kernels import (
    DEFAULT_GROUP_SIZE,
    aqsgd_update,
    backend_name,
    dequantize,
    quantize,
    reference,
    sym_dequantize,
    sym_quantize,
    sym_update,
)
from swarm.report import emit, median_seconds
from swarm.runtime.device import DeviceError, add_device_argument, resolve_device

COLUMNS = [
    "bits",
    "size",
    "numel",
    "quantize_gbps",
    "dequantize_gbps",
    "dequantize_into_gbps",
    "aqsgd_update_gbps",
    "memcpy_gbps",
    "quantize_vs_memcpy",
    "rel_error",
]
DEVICE_COLUMNS = [
    "quantizer",
    "bits",
    "rounding",
    "size",
    "quantize_gbps",
    "quantize_share",
    "quantize_kernel_gbps",
    "quantize_kernel_hbm",
    "dequantize_gbps",
    "dequantize_share",
    "update_gbps",
    "update_share",
    "copy_gbps",
    "quantize_hbm",
]
# Datasheet memory bandwidth, GB/s, by a substring of torch.cuda.get_device_name (the first match counts).
HBM_PEAK_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
)
ENCODING_COLUMNS = ["data", "bits", "fp16@128", "bf16@128", "fp32@128", "fp32@256", "fp32@512"]


@dataclass(frozen=True)
class KernelsBench:
    """`swarm bench kernels`: quantize/dequantize GB/s against a memory copy (the device is `--device`'s)."""

    bits: tuple[int, ...] = field(default=(2, 4, 8), metadata=flag(nargs="+"))
    """code widths"""
    sizes_kib: tuple[int, ...] = field(default=(64, 256, 1024, 4096, 16384, 65536), metadata=flag(nargs="+"))
    """tensor sizes in KiB of float32 (64 KiB to 64 MiB)"""
    group_size: int = DEFAULT_GROUP_SIZE
    """elements per scale/min pair"""
    repeats: int = 5
    """timed repeats; the median is reported"""
    nearest: bool = False
    """time round-to-nearest instead of stochastic"""
    threads: int = 0
    """torch threads (0: torch's own setting)"""
    quick: bool = False
    """64 KiB and 1 MiB only, 3 repeats: a smoke test"""
    encodings: bool = False
    """instead: error of fp16/bf16/fp32 scale encodings and group sizes on synthetic data"""
    json: bool = False
    """print rows as JSON instead of a table"""
    quantizer: str = field(default="aqsgd", metadata=flag(choices=("aqsgd", "acsgd")))
    """the CPU table's quantizer: aqsgd (min/scale, fp32 pairs) or acsgd (symmetric, fp16 scale)"""
    hbm_peak_gbps: float = 0.0
    """--device cuda: the memory's nominal peak in GB/s the kernels are compared with (0: the datasheet figure of
    a known device, none for others)"""


_FLAGS = Flags(KernelsBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    add_device_argument(parser)


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    if bench.threads:
        torch.set_num_threads(bench.threads)
    if args.device != "cpu":
        return _run_device(bench, args.device)
    if bench.encodings:
        emit(_encoding_rows(1 << 18 if bench.quick else 1 << 20), ENCODING_COLUMNS, bench.json,
             "relative error ||x - deQ(Q(x))|| / ||x - mean(x)||, stochastic rounding")  # fmt: skip
        return 0
    sizes_kib = [64, 1024] if bench.quick else bench.sizes_kib
    repeats = 3 if bench.quick else bench.repeats
    rows = []
    for size_kib in sizes_kib:
        x = torch.randn(size_kib * 1024 // 4, generator=torch.Generator().manual_seed(0))
        copy_target = torch.empty_like(x)
        memcpy_gbps = _gbps(x, median_seconds(lambda: copy_target.copy_(x), repeats, warmup=2))  # noqa: B023
        for bits in bench.bits:
            symmetric = bench.quantizer == "acsgd"
            rows.append(_row(x, bits, bench.group_size, not bench.nearest, repeats, memcpy_gbps, size_kib, symmetric))
    title = (
        f"quantizer={bench.quantizer} backend={backend_name('cpu', bench.group_size)} group_size={bench.group_size} "
        f"threads={torch.get_num_threads()} rounding={'nearest' if bench.nearest else 'stochastic'}; "
        "GB/s of float32 input"
    )
    emit(rows, COLUMNS, bench.json, title)
    return 0


def _row(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    stochastic: bool,
    repeats: int,
    memcpy: float,
    kib: int,
    symmetric: bool,
) -> dict:
    """One size x bits row: GB/s of quantize, dequantize (and into a given output: the asymmetric kernels
    have one), the fused AQ-SGD update against an fp16 buffer, and the round trip's relative error."""
    quant, dequant, update = (
        (sym_quantize, sym_dequantize, sym_update) if symmetric else (quantize, dequantize, aqsgd_update)
    )
    q = quant(x, bits, group_size, stochastic=stochastic, seed=0)
    buffer = torch.zeros(x.numel(), dtype=torch.float16)
    quantize_gbps = _gbps(x, median_seconds(lambda: quant(x, bits, group_size, stochastic=stochastic), repeats, 2))
    row = {
        "bits": bits,
        "size": f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB",
        "numel": x.numel(),
        "group_size": group_size,
        "quantize_gbps": quantize_gbps,
        "dequantize_gbps": _gbps(x, median_seconds(lambda: dequant(q), repeats, 2)),
    }
    if not symmetric:
        output = torch.empty_like(x)
        row["dequantize_into_gbps"] = _gbps(x, median_seconds(lambda: dequantize(q, out=output), repeats, 2))
    update_s = median_seconds(lambda: update(x, buffer, bits, group_size, stochastic=stochastic), repeats, 2)
    return row | {
        "aqsgd_update_gbps": _gbps(x, update_s),
        "memcpy_gbps": memcpy,
        "quantize_vs_memcpy": quantize_gbps / memcpy,
        "rel_error": float((dequant(q) - x).norm() / x.norm()),
    }


def _gbps(x: torch.Tensor, seconds: float) -> float:
    return x.numel() * 4 / seconds / 1e9


def _encoding_rows(numel: int) -> list[dict]:
    """Our float32 grid at several group sizes beside 16-bit pairs (min rounded down, scale up) at group 128."""
    generator = torch.Generator().manual_seed(0)
    hidden = 1024
    channel_scale = torch.ones(hidden)
    channel_scale[torch.randperm(hidden, generator=generator)[:8]] = 20.0  # a few outlier features
    data = {
        "N(0,1)": torch.randn(numel, generator=generator),
        "activations, 8/1024 outlier channels x20": (
            torch.randn(numel // hidden, hidden, generator=generator) * channel_scale
        ).reshape(-1),
        "gradients N(0,1e-7)": 1e-7 * torch.randn(numel, generator=generator),
        "gradients N(0,1e-9)": 1e-9 * torch.randn(numel, generator=generator),
        "offset N(30,0.1)": 30 + 0.1 * torch.randn(numel, generator=generator),
        "offset N(100,0.01)": 100 + 0.01 * torch.randn(numel, generator=generator),
    }
    rows = []
    for name, x in data.items():
        spread = float((x.double() - x.double().mean()).norm())
        for bits in (2, 4, 8):

            def error(y: torch.Tensor, x: torch.Tensor = x, spread: float = spread) -> float:
                return float((x.double() - y.double()).norm()) / spread

            row = {"data": name, "bits": bits}
            row["fp16@128"] = error(_sixteen_bit_pair(x, bits, 128, torch.float16, generator))
            row["bf16@128"] = error(_sixteen_bit_pair(x, bits, 128, torch.bfloat16, generator))
            for group_size in (128, 256, 512):
                q = reference.quantize(x, bits, group_size, seed=1)
                row[f"fp32@{group_size}"] = error(reference.dequantize(q))
            rows.append(row)
    return rows


def _sixteen_bit_pair(
    x: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """deQ(Q(x)) with min and scale stored in `dtype`: min rounded toward -inf, scale toward +inf."""
    levels = 2**bits - 1
    groups = x.view(-1, group_size)
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)
    lo_stored = lo.to(dtype)
    lo_stored = torch.where(
        lo_stored.float() > lo, torch.nextafter(lo_stored, lo_stored.new_tensor(-math.inf)), lo_stored
    )
    scale = ((hi - lo_stored.float()) / levels).to(dtype)
    for _ in range(4):  # bump the scale up until the codes cover the group
        short = lo_stored.float() + levels * scale.float() < hi
        scale = torch.where(short, torch.nextafter(scale, scale.new_tensor(math.inf)), scale)
    mins, scales = lo_stored.float()[:, None], scale.float()[:, None]
    v = (groups - mins) / torch.where(scales > 0, scales, 1.0)
    codes = torch.floor(v + torch.rand(groups.shape, generator=generator)).clamp(0, levels)
    return (mins + codes * scales).reshape(-1)


def _run_device(bench: KernelsBench, name: str) -> int:
    """The GPU table (module doc) on device `name`; a clear message and exit status 2 without CUDA."""
    try:
        device = resolve_device(name)
    except DeviceError as error:
        print(f"swarm bench kernels: {error}")
        return 2
    if bench.hbm_peak_gbps < 0:
        print(f"swarm bench kernels: --hbm-peak-gbps {bench.hbm_peak_gbps:g}: expected a positive GB/s or 0")
        return 2
    name = torch.cuda.get_device_name(device)
    peak = bench.hbm_peak_gbps or hbm_peak_gbps(name)
    numel = (1 << 20 if bench.quick else max(bench.sizes_kib) << 10) // 4
    x = torch.randn(numel, device=device, generator=torch.Generator(device).manual_seed(0))
    target = torch.empty_like(x)
    repeats = 3 if bench.quick else max(bench.repeats, 20)
    copy_gbps = 8 * numel / _cuda_seconds(lambda: target.copy_(x), repeats) / 1e9
    rows = []
    for quantizer in ("aqsgd", "acsgd"):
        for bits in bench.bits:
            for stochastic in (False, True):
                row = _device_row(quantizer, x, bits, bench.group_size, stochastic, repeats, copy_gbps)
                rows.append(row | {"device": name, "hbm_peak_gbps": peak, "quantize_hbm": _share(row, peak),
                                   "quantize_kernel_hbm": _share(row, peak, "quantize_kernel_gbps")})  # fmt: skip
    title = (
        f"{name} ({device}); group_size={bench.group_size}; GB/s of bytes read + written, share = of the "
        f"measured device-to-device copy ({copy_gbps:.0f} GB/s), hbm = of the nominal peak "
        f"({f'{peak:.0f} GB/s' if peak else 'unknown: --hbm-peak-gbps'}); quantize = the call (its NaN check "
        "syncs), quantize_kernel = its kernel alone"
    )
    emit(rows, DEVICE_COLUMNS, bench.json, title)
    return 0


def hbm_peak_gbps(device_name: str) -> float | None:
    """The datasheet memory bandwidth of a GPU named `device_name` (GB/s), None for one not in `HBM_PEAK_GBPS`."""
    return next((gbps for key, gbps in HBM_PEAK_GBPS if key.lower() in device_name.lower()), None)


def _share(row: dict, peak: float | None, key: str = "quantize_gbps") -> float | None:
    """The quantize call's (or `key`'s) GB/s as a share of the nominal peak (None without one)."""
    return row[key] / peak if peak else None


def _device_row(quantizer, x, bits, group_size, stochastic, repeats, copy_gbps) -> dict:
    numel = x.numel()
    groups = -(-numel // group_size)
    codes = numel * bits / 8 + groups * (2 if quantizer == "acsgd" else 8)  # packed codes + scales (and mins)
    buffer = torch.zeros(numel, dtype=torch.float16, device=x.device)
    from swarm.kernels import triton_kernels, triton_sym  # CUDA only: Triton is imported with the device table

    if quantizer == "acsgd":
        q = sym_quantize(x, bits, group_size, stochastic=stochastic, seed=0)
        ops = (
            lambda: sym_quantize(x, bits, group_size, stochastic=stochastic, seed=0),
            triton_sym.sym_quantize_launcher(x, bits, group_size, stochastic=stochastic)[0],
            lambda: sym_dequantize(q),
            lambda: sym_update(x, buffer, bits, group_size, stochastic=stochastic, seed=0),
        )
    else:
        q = quantize(x, bits, group_size, stochastic=stochastic, seed=0)
        out = torch.empty_like(x)
        ops = (
            lambda: quantize(x, bits, group_size, stochastic=stochastic, seed=0),
            triton_kernels.quantize_launcher(x, bits, group_size, stochastic=stochastic)[0],
            lambda: dequantize(q, out=out),
            lambda: aqsgd_update(x, buffer, bits, group_size, stochastic=stochastic, seed=0),
        )
    update = 4 * numel + 2 * buffer.element_size() * numel + codes  # a read, the buffer read and written
    moved = (4 * numel + codes, 4 * numel + codes, codes + 4 * numel, update)
    row = {"quantizer": quantizer, "bits": bits, "rounding": "stochastic" if stochastic else "nearest",
           "size": f"{4 * numel >> 20} MiB", "copy_gbps": copy_gbps}  # fmt: skip
    names = ("quantize", "quantize_kernel", "dequantize", "update")
    for name, op, nbytes in zip(names, ops, moved, strict=True):
        gbps = nbytes / _cuda_seconds(op, repeats) / 1e9
        row[f"{name}_gbps"], row[f"{name}_share"] = gbps, gbps / copy_gbps
    return row


def _cuda_seconds(fn, repeats: int) -> float:
    """Mean seconds per call over `repeats` back-to-back calls, by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats
