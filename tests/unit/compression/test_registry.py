"""The codec registry: complete, consistent, and the one source of names, validation and wire bits."""

from __future__ import annotations

import pytest

from swarm.compression import CODEC_NAMES, REGISTRY, CodecConfig, LinkState, codec_class, codec_labels, make_codec
from swarm.compression import codecs as registry
from swarm.kernels import DEFAULT_GROUP_SIZE
from swarm.proto import wire_pb2


def test_names_and_enums_are_one_to_one_and_in_the_usual_order():
    assert CODEC_NAMES[:6] == ("fp32", "fp16", "bf16", "directq", "aqsgd", "gradq")  # new codecs come after
    assert set(REGISTRY) == set(wire_pb2.Codec.values()) - {wire_pb2.CODEC_UNSPECIFIED}
    assert {cls.name for cls in REGISTRY.values()} == set(CODEC_NAMES)
    for enum, cls in REGISTRY.items():
        assert cls.wire == enum and codec_class(cls.name) is cls
        assert wire_pb2.Codec.Name(enum) == cls.name.upper()


@pytest.mark.parametrize("modules", [("codec_raw",), ("codec_raw", "codec_raw", "codec_directq")])
def test_an_incomplete_or_repeated_registry_fails_at_import(monkeypatch, modules):
    monkeypatch.setattr(registry, "CODEC_MODULES", modules)
    with pytest.raises(ImportError):
        registry._load()


@pytest.mark.parametrize(
    ("label", "bits"),
    [("fp32", 32), ("fp16", 16), ("bf16", 16), ("directq2", 2), ("aqsgd3", 3), ("gradq4+ef", 4), ("gradq8", 8)],
)
def test_wire_bits_are_the_planners_figures(label, bits):
    cfg = CodecConfig.parse(label)
    assert cfg.wire_bits == bits and isinstance(cfg.wire_bits, int)
    # the payload with its scales amortised over a large tensor: the nominal bits plus at most the scales' share
    numel = 1 << 20
    amortised = 8 * make_codec(cfg).payload_nbytes(numel) / numel
    if codec_class(cfg.name).quantized:
        assert bits < amortised <= bits + 2 * 32 / DEFAULT_GROUP_SIZE
    else:
        assert amortised == bits


def test_validation_follows_each_codecs_traits():
    for name in CODEC_NAMES:
        cls = codec_class(name)
        if cls.quantized:
            with pytest.raises(ValueError, match="bits"):
                CodecConfig(name=name, bits=5)
        else:
            rank = str(CodecConfig(name=name).rank) if cls.ranked else ""  # a ranked codec's label: lowrank4
            assert CodecConfig(name=name, bits=5).label == name + rank
        if cls.error_feedback:
            assert CodecConfig.parse(f"{name}4+ef").error_feedback
        else:
            with pytest.raises(ValueError, match="error_feedback applies to these codecs only: gradq, gsign, gtern"):
                CodecConfig(name=name, error_feedback=True)
        assert (LinkState(CodecConfig(name=name)).buffers is not None) == cls.uses_buffers
    with pytest.raises(ValueError, match="codec name must be one of"):
        codec_class("lz4")


def test_help_lists_every_codec_as_the_command_line_spells_it():
    labels = codec_labels()
    assert labels.startswith("fp32, fp16, bf16, directqN, aqsgdN, gradqN[+ef]")
    assert labels.endswith(" (N bits: 2, 3, 4, 8)")
    assert all(name in labels for name in CODEC_NAMES)


def test_label_suffixes_set_their_fields_over_the_defaults_and_round_trip():
    cfg = CodecConfig.parse("gradq2+ef+rot", stochastic=False, group_layout="flat")
    assert (cfg.bits, cfg.error_feedback, cfg.rotation, cfg.group_layout) == (2, True, "hadamard", "flat")
    assert CodecConfig.parse("aqsgd2+ch+sr", stochastic=False).stochastic is True
    assert CodecConfig.parse("aqsgd2+nr").stochastic is False
    for label in ("aqsgd2+ch", "gradq2+ef+rot", "directq4+ch+rot", "fp32"):
        assert CodecConfig.parse(label).label == label
    assert CodecConfig.parse("gradq2+ef+g256", group_size=1024).group_size == 256
    with pytest.raises(ValueError, match="group_size"):
        CodecConfig.parse("gradq2+g0")
    with pytest.raises(ValueError, match=r"unknown codec suffix \+zz"):
        CodecConfig.parse("aqsgd2+zz")
    with pytest.raises(ValueError, match="group_layout"):
        CodecConfig(name="aqsgd", group_layout="diagonal")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_declares_each_trait_and_its_label_grammar_reads_back(name):
    """What a codec says of itself is all that configs, labels, the planner, the benchmark and the runtime's
    link ends read: each trait a bool, its figures numbers, its default config's label parsed back whole."""
    cls = codec_class(name)
    for trait in cls.TRAITS:
        assert isinstance(getattr(cls, trait), bool), f"{name}.{trait}"
    cfg = CodecConfig(name=name)
    assert isinstance(cls.wire_bits(cfg), int) and cls.wire_bits(cfg) > 0
    assert 0 < cls.nominal_bits(cfg) <= 32
    cls.check(cfg)
    assert CodecConfig.parse(cfg.label) == cfg and cfg.label == cls.label(cfg)
    if cls.device_encoded:
        assert cls.uses_buffers, "a device-encoded codec's buffers are what stays on the device"
    variants = {"error_feedback": "+ef", "rated": "+r50", "compact_scales": "+cs"}
    for trait, suffix in variants.items():
        label = cfg.label + suffix
        if getattr(cls, trait):
            assert CodecConfig.parse(label).label == label
        else:
            with pytest.raises(ValueError):
                CodecConfig.parse(label)


def test_the_traits_keep_what_the_tables_elsewhere_said():
    """The runtime's device-encoded set, the codec benchmark's bits column and the config's name checks were
    tables outside the codecs; the traits that replace them give the same answers."""
    assert {n for n in CODEC_NAMES if codec_class(n).device_encoded} == {"acsgd", "bilevel"}
    nominal = {"fp32": 32, "fp16": 16, "bf16": 16, "tern": 1.6, "bilevel": 1, "gsign": 1, "gtern": 1.6}
    for name, bits in nominal.items():
        assert codec_class(name).nominal_bits(CodecConfig(name=name)) == bits
    assert codec_class("lowrank").nominal_bits(CodecConfig.parse("lowrank4+f8")) == 8
    assert codec_class("directq").nominal_bits(CodecConfig.parse("directq2")) == 2
    assert {n for n in CODEC_NAMES if codec_class(n).rated} == {"tern", "gtern"}
    assert {n for n in CODEC_NAMES if codec_class(n).compact_scales} == {"gradq"}
    assert CodecConfig.parse("lowrank8+ef+f8").label == "lowrank8+ef+f8"
    for bad in ("lowrank0", "lowrank65", "lowrank4+f2"):
        with pytest.raises(ValueError, match="rank|factor_bits"):
            CodecConfig.parse(bad)


def test_a_codec_without_a_trait_fails_the_registry_at_import(monkeypatch):
    monkeypatch.setattr(codec_class("tern"), "rated", None)
    with pytest.raises(ImportError, match="tern"):
        registry._load()
