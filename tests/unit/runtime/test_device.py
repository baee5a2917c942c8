"""`--device` and the CUDA data path: parsing, the error without CUDA, and that "cpu" changes nothing.
CUDA-only tests (marked `cuda`) skip with a reason here; scripts/gpu-check.sh runs them on a GPU."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, MemoryBufferStore, WireLimits, frame, make_codec, unframe
from swarm.daemon.peer_config import build_parser, config_from_args
from swarm.kernels.host_copy import to_host
from swarm.runtime import device
from swarm.runtime.boundary import LinkEnd, LinkEnds
from swarm.runtime.device import (
    DeviceBufferStore,
    DeviceError,
    add_device_argument,
    check_device,
    parse_device,
    resolve_device,
    to_device,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA unavailable here)")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("text", "value"), [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:0", "cuda:0"), ("CUDA:12", "cuda:12")]
)
def test_device_names_parse(text, value):
    assert parse_device(text) == value


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:01", "cpu:0", "", "cuda:0 cpu", "cuda:99999", "mps"])
def test_malformed_device_names_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_device(text)
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", text])


def test_the_argument_defaults_to_cpu():
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    assert parser.parse_args([]).device == "cpu"
    assert parser.parse_args(["--device", "cuda:1"]).device == "cuda:1"


def test_cpu_resolves_to_itself():
    assert resolve_device("cpu") == torch.device("cpu") and check_device("cpu") == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(no_cuda, name):
    with pytest.raises(DeviceError, match="CUDA is not available.*--device cpu"):
        resolve_device(name)


def test_a_missing_gpu_index_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"2 CUDA device\(s\)"):
        resolve_device("cuda:2")


def test_swarm_peer_refuses_cuda_without_cuda_before_it_starts(no_cuda):
    args = build_parser().parse_args(["--device", "cuda"])
    with pytest.raises(DeviceError):
        config_from_args(args)
    assert config_from_args(build_parser().parse_args([])).device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--device", "tpu"])


def test_to_device_on_cpu_is_the_identity():
    a, b = torch.randn(3), torch.arange(4)
    moved = to_device("cpu", a, None, b)
    assert moved[0] is a and moved[1] is None and moved[2] is b


def test_a_stage_asking_for_cuda_without_it_fails_at_placement(no_cuda):
    links = LinkEnds(CodecConfig.parse("acsgd2+ch+nr"), CodecConfig.parse("fp32"))
    with pytest.raises(DeviceError):
        links.place_on("cuda")
    assert links.place_on("cpu") == torch.device("cpu")


def test_the_device_cannot_change_once_an_end_has_sent():
    links = LinkEnds(CodecConfig.parse("acsgd2+ch+nr"), CodecConfig.parse("fp32"))
    links.send_end("fw", "peer:1")
    assert links.place_on("cpu") == torch.device("cpu")  # unchanged: fine
    links.device = torch.device("meta")  # as if placed elsewhere before
    with pytest.raises(RuntimeError, match="before its first send"):
        links.place_on("cpu")


def test_only_device_encoded_codecs_keep_their_sending_end_on_the_device():
    cuda = torch.device("cuda", 0)  # nothing is allocated until a sample is admitted
    acsgd = LinkEnd(CodecConfig.parse("acsgd2+ch+nr"), "fw-send", cuda)
    assert acsgd.device == cuda and isinstance(acsgd.buffers, DeviceBufferStore)
    bilevel = LinkEnd(CodecConfig.parse("bilevel+ch+fsl32+s20"), "fw-send", cuda)
    assert bilevel.device == cuda and isinstance(bilevel.buffers, DeviceBufferStore)
    gradq = LinkEnd(CodecConfig.parse("gradq2+ef+rot+nr+cs+g1024"), "bw-send", cuda)
    assert gradq.device == torch.device("cpu")
    assert LinkEnd(CodecConfig.parse("acsgd2+ch+nr"), "fw-send").device == torch.device("cpu")
    assert type(LinkEnd(CodecConfig.parse("acsgd2+ch+nr"), "x").buffers) is MemoryBufferStore


def test_a_device_store_behaves_as_a_memory_store():
    gen = torch.Generator().manual_seed(0)
    stores = [MemoryBufferStore(8, torch.float16), DeviceBufferStore(8, torch.float16, "cpu")]
    for store in stores:
        store.admit([5, 6, 7], torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(1)))
        store.scatter(store.lookup([6]), torch.randn(1, 4, 2, generator=gen))
        store.forget([5])
        store.admit([9], torch.ones(1, 4, 2))
        gen = torch.Generator().manual_seed(0)
    a, b = (s.gather(s.lookup([6, 7, 9])) for s in stores)
    assert torch.equal(a, b) and stores[1].gather([]).shape == (0, 4, 2)


def test_cpu_stage_links_encode_as_before():
    """device="cpu" leaves the data path as it was: the same message bytes as the codec alone."""
    cfg = CodecConfig.parse("acsgd2+ch+nr", seed=3)
    links = LinkEnds(cfg, CodecConfig.parse("fp32"), adaptive_zstd=False)
    links.place_on("cpu")
    codec, state = make_codec(cfg), LinkState(cfg)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(3, 16, 24, generator=gen)
        ids = [step, step + 1, step + 2]
        end = links.send_end("fw", "next:1")
        with links.lock:
            got = end.codec.encode(x, sample_ids=ids, state=end.state)
        want = codec.encode(x, sample_ids=ids, state=state)
        assert got.SerializeToString() == want.SerializeToString()
        out = links.incoming(links.forward_recv, unframe(list(frame(got))), WireLimits())
        assert out.device.type == "cpu"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("label", ["acsgd2+ch+nr", "acsgd2+ch+nr+fsl32+fslw4+dsl16+s20", "bilevel+ch+fsl32+s20"])
def test_a_cuda_sending_end_encodes_on_the_device_and_the_cpu_receiver_agrees(label):
    """acsgd's kernels write the same bytes on either device; bilevel's torch ops may sum a group's levels in
    another order on the GPU, so its messages may differ from a CPU sender's, but never from what the receiver's
    buffers hold."""
    cfg = CodecConfig.parse(label, seed=3)
    gpu = LinkEnds(cfg, CodecConfig.parse("fp32"), adaptive_zstd=False)
    gpu.place_on("cuda")
    codec, cpu_state, recv = make_codec(cfg), LinkState(cfg), LinkState(cfg)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(3, 16, 24, generator=gen)
        ids = [step % 3, step % 3 + 1, step % 3 + 2]
        end = gpu.send_end("fw", "next:1")
        with gpu.lock:
            on_gpu = end.codec.encode(x.cuda(), sample_ids=ids, state=end.state)
        assert end.buffers.gather(end.buffers.lookup(ids)).device.type == "cuda"
        on_cpu = codec.encode(x, sample_ids=ids, state=cpu_state)
        if label.startswith("acsgd"):
            assert on_gpu.SerializeToString() == on_cpu.SerializeToString()  # the same bytes from either device
        on_host = make_codec(cfg).decode(on_gpu, state=recv)
        # a cuda receiving end decodes the same stream (first sights, then deltas on its device buffers)
        decoded = gpu.incoming(gpu.forward_recv, unframe(list(frame(on_cpu))), WireLimits())
        assert decoded.device.type == "cuda"
        torch.testing.assert_close(decoded.cpu().float(), on_host.float(), rtol=1e-6, atol=1e-6)
    sent = end.buffers.gather(end.buffers.lookup([0, 1, 2])).cpu()
    got = recv.buffers.gather(recv.buffers.lookup([0, 1, 2]))
    assert torch.equal(sent.view(torch.int16), got.view(torch.int16))


def test_host_copies_of_cpu_tensors_are_the_tensors():
    a, b = torch.randn(3), torch.zeros(2, dtype=torch.uint8)
    got = to_host(a, b)
    assert got[0] is a and got[1] is b


@pytest.mark.cuda
@needs_cuda
def test_host_copies_of_cuda_tensors_are_pinned_and_exact():
    a = torch.randn(1 << 20, device="cuda")
    codes = (a > 0).to(torch.uint8)
    host_a, host_codes = to_host(a, codes)
    assert host_a.is_pinned() and host_codes.is_pinned()
    assert torch.equal(host_a, a.cpu()) and torch.equal(host_codes, codes.cpu())


@pytest.mark.parametrize("label", ["acsgd2+ch+nr+fs4", "acsgd2+ch+nr+fsl32+fslw4+dsl16+s20", "bilevel+ch+fsl32+s20"])
def test_the_codec_on_a_device_store_sends_what_it_sends_on_a_memory_store(label):
    """The device store's gather/scatter/admit in the codec's own flow (on the CPU: the same bytes)."""
    cfg = CodecConfig.parse(label, seed=3)
    codec = make_codec(cfg)
    memory = LinkState(cfg, MemoryBufferStore(cfg.buffer_capacity, cfg.torch_buffer_dtype))
    device = LinkState(cfg, DeviceBufferStore(cfg.buffer_capacity, cfg.torch_buffer_dtype, "cpu"))
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(3, 16, 24, generator=gen)
        ids = [step % 3, step % 3 + 1, 7]
        a = codec.encode(x, sample_ids=ids, state=memory)
        b = codec.encode(x, sample_ids=ids, state=device)
        assert a.SerializeToString() == b.SerializeToString()


def test_the_demo_refuses_cuda_without_cuda_before_it_starts_a_process(no_cuda, tmp_path, capsys):
    from swarm.cli import main

    assert main(["demo", "--device", "cuda", "--out", str(tmp_path / "demo")]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "demo" / "steps.csv").exists()


# ---- --cpus and the compute key ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, cpus", [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("3,1", (1, 3)), ("1, 4-5,4", (1, 4, 5)), ("none", None)]
)
def test_a_cpu_list_reads_as_linux_writes_it_and_back(text, cpus):
    assert device.parse_cpus(text) == cpus
    assert device.parse_cpus(device.render_cpus(cpus)) == cpus


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "0-", "1,,2", "0.5", "12345"])
def test_a_malformed_cpu_list_is_refused_by_name(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="cpus"):
        device.parse_cpus(bad)


def test_pinning_to_cpus_this_process_may_not_use_is_refused_naming_them_and_changes_nothing():
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="no CPU \\[4095\\]"):
        device.pin_cpus((min(before), 4095))
    assert os.sched_getaffinity(0) == before
    # swarm-peer says so before it starts anything
    args = build_parser().parse_args(["--cpus", "4095"])
    with pytest.raises(ValueError, match="--cpus 4095: no CPU \\[4095\\]"):
        config_from_args(args)


def test_pinning_runs_the_process_and_the_children_it_starts_on_those_cpus():
    one = (min(os.sched_getaffinity(0)),)
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    code = (
        "import os, subprocess, sys; from swarm.runtime.device import pin_cpus; pin_cpus(tuple(map(int, sys.argv[1:])))"
        "; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush()"
        f"; subprocess.run([sys.executable, '-c', {child!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, one)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(list(one))] * 2, "the process and the child it started after pinning"


def test_the_compute_key_names_the_machine_device_and_cpu_set():
    key = device.compute_key("cpu", (0,))
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == device.compute_key("cpu", (0,)), "one machine and CPU set: one key, peer after peer"
    assert key != device.compute_key("cpu", (0, 1)) != device.compute_key("cuda:0") != device.compute_key("cuda:1")
    assert device.compute_key("cpu") == device.compute_key("cpu", tuple(os.sched_getaffinity(0)))
    # a named group is the same key on any device or machine, and another group's is another
    assert device.compute_key("cpu", (0,), "rack-1") == device.compute_key("cuda:0", None, "rack-1") != key
    assert device.compute_key("cpu", None, "rack-1") != device.compute_key("cpu", None, "rack-2")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert f.read().strip().replace("-", "")[:16] != key
