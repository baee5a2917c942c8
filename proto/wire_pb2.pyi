from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    FP32: _ClassVar[Codec]
    FP16: _ClassVar[Codec]
    BF16: _ClassVar[Codec]
    DIRECTQ: _ClassVar[Codec]
    AQSGD: _ClassVar[Codec]
    GRADQ: _ClassVar[Codec]
    ACSGD: _ClassVar[Codec]
    TERN: _ClassVar[Codec]
    BILEVEL: _ClassVar[Codec]
    GSIGN: _ClassVar[Codec]
    GTERN: _ClassVar[Codec]
    LOWRANK: _ClassVar[Codec]
    MLOWRANK: _ClassVar[Codec]
    TOPK: _ClassVar[Codec]

class GroupLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_LAYOUT_FLAT: _ClassVar[GroupLayout]
    GROUP_LAYOUT_CHANNEL: _ClassVar[GroupLayout]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    ZSTD: _ClassVar[Compression]
    ZSTD_SPLIT: _ClassVar[Compression]
CODEC_UNSPECIFIED: Codec
FP32: Codec
FP16: Codec
BF16: Codec
DIRECTQ: Codec
AQSGD: Codec
GRADQ: Codec
ACSGD: Codec
TERN: Codec
BILEVEL: Codec
GSIGN: Codec
GTERN: Codec
LOWRANK: Codec
MLOWRANK: Codec
TOPK: Codec
GROUP_LAYOUT_FLAT: GroupLayout
GROUP_LAYOUT_CHANNEL: GroupLayout
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
COMPRESSION_NONE: Compression
ZSTD: Compression
ZSTD_SPLIT: Compression

class ByteSplit(_message.Message):
    __slots__ = ("count", "top", "low", "low_zstd")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    LOW_ZSTD_FIELD_NUMBER: _ClassVar[int]
    count: int
    top: bytes
    low: bytes
    low_zstd: bool
    def __init__(self, count: _Optional[int] = ..., top: _Optional[bytes] = ..., low: _Optional[bytes] = ..., low_zstd: _Optional[bool] = ...) -> None: ...

class Quantized(_message.Message):
    __slots__ = ("bits", "group_size", "numel", "scales", "mins", "payload", "scale_dtype")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    MINS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    bits: int
    group_size: int
    numel: int
    scales: bytes
    mins: bytes
    payload: bytes
    scale_dtype: DType
    def __init__(self, bits: _Optional[int] = ..., group_size: _Optional[int] = ..., numel: _Optional[int] = ..., scales: _Optional[bytes] = ..., mins: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., scale_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class TensorMessage(_message.Message):
    __slots__ = ("shape", "dtype", "codec", "sample_ids", "sample_is_delta", "quantized", "raw_dtype", "raw", "quantized_full", "buffer_digest", "group_layout", "first_sight_basis", "delta_basis", "rotation", "rotation_seed", "sparse", "factors", "raw_split")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IS_DELTA_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    RAW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FULL_FIELD_NUMBER: _ClassVar[int]
    BUFFER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SIGHT_BASIS_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASIS_FIELD_NUMBER: _ClassVar[int]
    ROTATION_FIELD_NUMBER: _ClassVar[int]
    ROTATION_SEED_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    FACTORS_FIELD_NUMBER: _ClassVar[int]
    RAW_SPLIT_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: Codec
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_is_delta: _containers.RepeatedScalarFieldContainer[bool]
    quantized: Quantized
    raw_dtype: DType
    raw: bytes
    quantized_full: Quantized
    buffer_digest: int
    group_layout: GroupLayout
    first_sight_basis: Quantized
    delta_basis: Quantized
    rotation: int
    rotation_seed: int
    sparse: Sparse
    factors: _containers.RepeatedCompositeFieldContainer[Quantized]
    raw_split: ByteSplit
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., sample_is_delta: _Optional[_Iterable[bool]] = ..., quantized: _Optional[_Union[Quantized, _Mapping]] = ..., raw_dtype: _Optional[_Union[DType, str]] = ..., raw: _Optional[bytes] = ..., quantized_full: _Optional[_Union[Quantized, _Mapping]] = ..., buffer_digest: _Optional[int] = ..., group_layout: _Optional[_Union[GroupLayout, str]] = ..., first_sight_basis: _Optional[_Union[Quantized, _Mapping]] = ..., delta_basis: _Optional[_Union[Quantized, _Mapping]] = ..., rotation: _Optional[int] = ..., rotation_seed: _Optional[int] = ..., sparse: _Optional[_Union[Sparse, _Mapping]] = ..., factors: _Optional[_Iterable[_Union[Quantized, _Mapping]]] = ..., raw_split: _Optional[_Union[ByteSplit, _Mapping]] = ...) -> None: ...

class Sparse(_message.Message):
    __slots__ = ("group_size", "keep", "bits", "index", "codes", "lo", "hi")
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    keep: int
    bits: int
    index: bytes
    codes: bytes
    lo: bytes
    hi: bytes
    def __init__(self, group_size: _Optional[int] = ..., keep: _Optional[int] = ..., bits: _Optional[int] = ..., index: _Optional[bytes] = ..., codes: _Optional[bytes] = ..., lo: _Optional[bytes] = ..., hi: _Optional[bytes] = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("compression", "body_bytes", "raw_body_bytes", "codec", "shape", "dtype")
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    compression: Compression
    body_bytes: int
    raw_body_bytes: int
    codec: Codec
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, compression: _Optional[_Union[Compression, str]] = ..., body_bytes: _Optional[int] = ..., raw_body_bytes: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FrameHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FrameHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
