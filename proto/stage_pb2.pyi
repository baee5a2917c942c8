from swarm.proto import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallInfo(_message.Message):
    __slots__ = ("step", "micro_batch", "stage", "plan_version", "num_micro_batches", "schedule", "route", "route_peers", "deadline_s", "loss_weight", "chain", "stage_micro", "stage_micro_count", "tied", "loss_scale", "attempt_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_PEERS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    STAGE_MICRO_FIELD_NUMBER: _ClassVar[int]
    STAGE_MICRO_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    micro_batch: int
    stage: int
    plan_version: int
    num_micro_batches: int
    schedule: str
    route: _containers.RepeatedScalarFieldContainer[str]
    route_peers: _containers.RepeatedScalarFieldContainer[str]
    deadline_s: float
    loss_weight: float
    chain: int
    stage_micro: _containers.RepeatedScalarFieldContainer[int]
    stage_micro_count: _containers.RepeatedScalarFieldContainer[int]
    tied: bool
    loss_scale: float
    attempt_id: int
    def __init__(self, step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., stage: _Optional[int] = ..., plan_version: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., schedule: _Optional[str] = ..., route: _Optional[_Iterable[str]] = ..., route_peers: _Optional[_Iterable[str]] = ..., deadline_s: _Optional[float] = ..., loss_weight: _Optional[float] = ..., chain: _Optional[int] = ..., stage_micro: _Optional[_Iterable[int]] = ..., stage_micro_count: _Optional[_Iterable[int]] = ..., tied: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., attempt_id: _Optional[int] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("shape", "tokens", "sample_ids", "width", "zstd")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    tokens: bytes
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    width: int
    zstd: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., tokens: _Optional[bytes] = ..., sample_ids: _Optional[_Iterable[int]] = ..., width: _Optional[int] = ..., zstd: _Optional[bool] = ...) -> None: ...

class StreamItem(_message.Message):
    __slots__ = ("info", "tokens", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: CallInfo
    tokens: TokenBatch
    chunk: _wire_pb2.Chunk
    def __init__(self, info: _Optional[_Union[CallInfo, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., chunk: _Optional[_Union[_wire_pb2.Chunk, _Mapping]] = ...) -> None: ...

class Traffic(_message.Message):
    __slots__ = ("wire_bytes", "fp32_wire_bytes", "link_bytes")
    class LinkBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP32_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    wire_bytes: int
    fp32_wire_bytes: int
    link_bytes: _containers.ScalarMap[int, int]
    def __init__(self, wire_bytes: _Optional[int] = ..., fp32_wire_bytes: _Optional[int] = ..., link_bytes: _Optional[_Mapping[int, int]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("has_loss", "loss", "traffic", "plan_route")
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    PLAN_ROUTE_FIELD_NUMBER: _ClassVar[int]
    has_loss: bool
    loss: float
    traffic: Traffic
    plan_route: bool
    def __init__(self, has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., traffic: _Optional[_Union[Traffic, _Mapping]] = ..., plan_route: _Optional[bool] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("traffic", "plan_route")
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    PLAN_ROUTE_FIELD_NUMBER: _ClassVar[int]
    traffic: Traffic
    plan_route: bool
    def __init__(self, traffic: _Optional[_Union[Traffic, _Mapping]] = ..., plan_route: _Optional[bool] = ...) -> None: ...

class LabelsRequest(_message.Message):
    __slots__ = ("info", "labels", "micro_rows")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MICRO_ROWS_FIELD_NUMBER: _ClassVar[int]
    info: CallInfo
    labels: TokenBatch
    micro_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, info: _Optional[_Union[CallInfo, _Mapping]] = ..., labels: _Optional[_Union[TokenBatch, _Mapping]] = ..., micro_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("newest_plan",)
    NEWEST_PLAN_FIELD_NUMBER: _ClassVar[int]
    newest_plan: int
    def __init__(self, newest_plan: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step", "tied_grad_sum", "global_grad_norm", "abandon", "plan_version", "skip", "loss_scale", "trainer_elapsed_s", "frozen_layers", "attempt_id", "want_digest", "digest_stride", "digest_seed", "previous_digest_seed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIED_GRAD_SUM_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    FROZEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STRIDE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SEED_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_DIGEST_SEED_FIELD_NUMBER: _ClassVar[int]
    step: int
    tied_grad_sum: _wire_pb2.TensorMessage
    global_grad_norm: float
    abandon: bool
    plan_version: int
    skip: bool
    loss_scale: float
    trainer_elapsed_s: float
    frozen_layers: int
    attempt_id: int
    want_digest: bool
    digest_stride: int
    digest_seed: int
    previous_digest_seed: int
    def __init__(self, step: _Optional[int] = ..., tied_grad_sum: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., global_grad_norm: _Optional[float] = ..., abandon: _Optional[bool] = ..., plan_version: _Optional[int] = ..., skip: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., trainer_elapsed_s: _Optional[float] = ..., frozen_layers: _Optional[int] = ..., attempt_id: _Optional[int] = ..., want_digest: _Optional[bool] = ..., digest_stride: _Optional[int] = ..., digest_seed: _Optional[int] = ..., previous_digest_seed: _Optional[int] = ...) -> None: ...

class GradReply(_message.Message):
    __slots__ = ("tied_grad", "grad_sq_norm", "loss_scale", "layer_sq_norms")
    TIED_GRAD_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LAYER_SQ_NORMS_FIELD_NUMBER: _ClassVar[int]
    tied_grad: _wire_pb2.TensorMessage
    grad_sq_norm: float
    loss_scale: float
    layer_sq_norms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tied_grad: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., grad_sq_norm: _Optional[float] = ..., loss_scale: _Optional[float] = ..., layer_sq_norms: _Optional[_Iterable[float]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "lr", "loss_scale", "skipped", "weights_digest", "previous_digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    lr: float
    loss_scale: float
    skipped: bool
    weights_digest: str
    previous_digest: str
    def __init__(self, step: _Optional[int] = ..., lr: _Optional[float] = ..., loss_scale: _Optional[float] = ..., skipped: _Optional[bool] = ..., weights_digest: _Optional[str] = ..., previous_digest: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("peer_id", "stage", "layer_start", "layer_end", "plan_version", "steps_done", "compute_layers_per_s", "buffered_samples", "device", "metrics", "weights_digest", "replica", "last_step", "step_open", "model_identity")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_LAYERS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_OPEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    layer_start: int
    layer_end: int
    plan_version: int
    steps_done: int
    compute_layers_per_s: float
    buffered_samples: int
    device: str
    metrics: _containers.ScalarMap[str, float]
    weights_digest: str
    replica: int
    last_step: int
    step_open: bool
    model_identity: str
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., plan_version: _Optional[int] = ..., steps_done: _Optional[int] = ..., compute_layers_per_s: _Optional[float] = ..., buffered_samples: _Optional[int] = ..., device: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., weights_digest: _Optional[str] = ..., replica: _Optional[int] = ..., last_step: _Optional[int] = ..., step_open: _Optional[bool] = ..., model_identity: _Optional[str] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("step", "plan_version", "stage", "group_peers", "group_addresses", "deadline_s", "tied_peers", "tied_addresses", "attempt_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_PEERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TIED_PEERS_FIELD_NUMBER: _ClassVar[int]
    TIED_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan_version: int
    stage: int
    group_peers: _containers.RepeatedScalarFieldContainer[str]
    group_addresses: _containers.RepeatedScalarFieldContainer[str]
    deadline_s: float
    tied_peers: _containers.RepeatedScalarFieldContainer[str]
    tied_addresses: _containers.RepeatedScalarFieldContainer[str]
    attempt_id: int
    def __init__(self, step: _Optional[int] = ..., plan_version: _Optional[int] = ..., stage: _Optional[int] = ..., group_peers: _Optional[_Iterable[str]] = ..., group_addresses: _Optional[_Iterable[str]] = ..., deadline_s: _Optional[float] = ..., tied_peers: _Optional[_Iterable[str]] = ..., tied_addresses: _Optional[_Iterable[str]] = ..., attempt_id: _Optional[int] = ...) -> None: ...

class ReduceReply(_message.Message):
    __slots__ = ("wire_bytes", "fp32_wire_bytes", "group_size", "tied_wire_bytes", "tied_fp32_wire_bytes", "grads")
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP32_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIED_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIED_FP32_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    wire_bytes: int
    fp32_wire_bytes: int
    group_size: int
    tied_wire_bytes: int
    tied_fp32_wire_bytes: int
    grads: GradReply
    def __init__(self, wire_bytes: _Optional[int] = ..., fp32_wire_bytes: _Optional[int] = ..., group_size: _Optional[int] = ..., tied_wire_bytes: _Optional[int] = ..., tied_fp32_wire_bytes: _Optional[int] = ..., grads: _Optional[_Union[GradReply, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("stage", "plan_version", "max_bytes_per_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    stage: int
    plan_version: int
    max_bytes_per_s: float
    def __init__(self, stage: _Optional[int] = ..., plan_version: _Optional[int] = ..., max_bytes_per_s: _Optional[float] = ...) -> None: ...

class StateItem(_message.Message):
    __slots__ = ("name", "chunk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunk: _wire_pb2.Chunk
    def __init__(self, name: _Optional[str] = ..., chunk: _Optional[_Union[_wire_pb2.Chunk, _Mapping]] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("step", "plan_version", "stage", "micro_batch", "backward", "compact", "sketch_seed", "sketch_size", "direct")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan_version: int
    stage: int
    micro_batch: int
    backward: bool
    compact: bool
    sketch_seed: int
    sketch_size: int
    direct: bool
    def __init__(self, step: _Optional[int] = ..., plan_version: _Optional[int] = ..., stage: _Optional[int] = ..., micro_batch: _Optional[int] = ..., backward: _Optional[bool] = ..., compact: _Optional[bool] = ..., sketch_seed: _Optional[int] = ..., sketch_size: _Optional[int] = ..., direct: _Optional[bool] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("input", "tokens", "output", "loss", "grad_received", "grad_sent", "input_scale", "output_scale", "grad_received_scale", "grad_sent_scale", "output_sketch", "grad_received_sketch", "grad_sent_sketch", "input_sketch", "input_digest", "grad_received_digest", "grad_received_wire", "zstd_body")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GRAD_SENT_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCALE_FIELD_NUMBER: _ClassVar[int]
    GRAD_RECEIVED_SCALE_FIELD_NUMBER: _ClassVar[int]
    GRAD_SENT_SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SKETCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_RECEIVED_SKETCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_SENT_SKETCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_SKETCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_RECEIVED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_RECEIVED_WIRE_FIELD_NUMBER: _ClassVar[int]
    ZSTD_BODY_FIELD_NUMBER: _ClassVar[int]
    input: _wire_pb2.TensorMessage
    tokens: TokenBatch
    output: _wire_pb2.TensorMessage
    loss: float
    grad_received: _wire_pb2.TensorMessage
    grad_sent: _wire_pb2.TensorMessage
    input_scale: int
    output_scale: int
    grad_received_scale: int
    grad_sent_scale: int
    output_sketch: _containers.RepeatedScalarFieldContainer[float]
    grad_received_sketch: _containers.RepeatedScalarFieldContainer[float]
    grad_sent_sketch: _containers.RepeatedScalarFieldContainer[float]
    input_sketch: _containers.RepeatedScalarFieldContainer[float]
    input_digest: bytes
    grad_received_digest: bytes
    grad_received_wire: _wire_pb2.TensorMessage
    zstd_body: bytes
    def __init__(self, input: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., output: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., loss: _Optional[float] = ..., grad_received: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., grad_sent: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., input_scale: _Optional[int] = ..., output_scale: _Optional[int] = ..., grad_received_scale: _Optional[int] = ..., grad_sent_scale: _Optional[int] = ..., output_sketch: _Optional[_Iterable[float]] = ..., grad_received_sketch: _Optional[_Iterable[float]] = ..., grad_sent_sketch: _Optional[_Iterable[float]] = ..., input_sketch: _Optional[_Iterable[float]] = ..., input_digest: _Optional[bytes] = ..., grad_received_digest: _Optional[bytes] = ..., grad_received_wire: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., zstd_body: _Optional[bytes] = ...) -> None: ...

class RecomputeRequest(_message.Message):
    __slots__ = ("step", "plan_version", "stage", "input", "tokens", "targets", "grad", "loss_weight", "backward", "compact", "input_scale", "grad_scale", "sketch_seed", "sketch_size", "fetch_peer", "micro_batch", "input_digest", "grad_digest", "sketch_digests_only")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCALE_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FETCH_PEER_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SKETCH_DIGESTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan_version: int
    stage: int
    input: _wire_pb2.TensorMessage
    tokens: TokenBatch
    targets: TokenBatch
    grad: _wire_pb2.TensorMessage
    loss_weight: float
    backward: bool
    compact: bool
    input_scale: int
    grad_scale: int
    sketch_seed: int
    sketch_size: int
    fetch_peer: str
    micro_batch: int
    input_digest: bytes
    grad_digest: bytes
    sketch_digests_only: bool
    def __init__(self, step: _Optional[int] = ..., plan_version: _Optional[int] = ..., stage: _Optional[int] = ..., input: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., targets: _Optional[_Union[TokenBatch, _Mapping]] = ..., grad: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., loss_weight: _Optional[float] = ..., backward: _Optional[bool] = ..., compact: _Optional[bool] = ..., input_scale: _Optional[int] = ..., grad_scale: _Optional[int] = ..., sketch_seed: _Optional[int] = ..., sketch_size: _Optional[int] = ..., fetch_peer: _Optional[str] = ..., micro_batch: _Optional[int] = ..., input_digest: _Optional[bytes] = ..., grad_digest: _Optional[bytes] = ..., sketch_digests_only: _Optional[bool] = ...) -> None: ...

class RecomputeReply(_message.Message):
    __slots__ = ("output", "loss", "grad_in", "output_scale", "grad_in_scale", "output_sketch", "grad_in_sketch", "fetched_bytes", "input_sketch_digest", "grad_sketch_digest", "output_sketch_digest", "grad_in_sketch_digest")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_IN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCALE_FIELD_NUMBER: _ClassVar[int]
    GRAD_IN_SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SKETCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_IN_SKETCH_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SKETCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_SKETCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SKETCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_IN_SKETCH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    output: _wire_pb2.TensorMessage
    loss: float
    grad_in: _wire_pb2.TensorMessage
    output_scale: int
    grad_in_scale: int
    output_sketch: _containers.RepeatedScalarFieldContainer[float]
    grad_in_sketch: _containers.RepeatedScalarFieldContainer[float]
    fetched_bytes: int
    input_sketch_digest: bytes
    grad_sketch_digest: bytes
    output_sketch_digest: bytes
    grad_in_sketch_digest: bytes
    def __init__(self, output: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., loss: _Optional[float] = ..., grad_in: _Optional[_Union[_wire_pb2.TensorMessage, _Mapping]] = ..., output_scale: _Optional[int] = ..., grad_in_scale: _Optional[int] = ..., output_sketch: _Optional[_Iterable[float]] = ..., grad_in_sketch: _Optional[_Iterable[float]] = ..., fetched_bytes: _Optional[int] = ..., input_sketch_digest: _Optional[bytes] = ..., grad_sketch_digest: _Optional[bytes] = ..., output_sketch_digest: _Optional[bytes] = ..., grad_in_sketch_digest: _Optional[bytes] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reached", "detail")
    REACHED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reached: bool
    detail: str
    def __init__(self, reached: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("target", "conn_id", "data", "splice", "splice_port", "splice_secret")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CONN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SPLICE_FIELD_NUMBER: _ClassVar[int]
    SPLICE_PORT_FIELD_NUMBER: _ClassVar[int]
    SPLICE_SECRET_FIELD_NUMBER: _ClassVar[int]
    target: str
    conn_id: int
    data: bytes
    splice: bool
    splice_port: int
    splice_secret: bytes
    def __init__(self, target: _Optional[str] = ..., conn_id: _Optional[int] = ..., data: _Optional[bytes] = ..., splice: _Optional[bool] = ..., splice_port: _Optional[int] = ..., splice_secret: _Optional[bytes] = ...) -> None: ...

class AttachUp(_message.Message):
    __slots__ = ("keepalive",)
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    keepalive: bool
    def __init__(self, keepalive: _Optional[bool] = ...) -> None: ...

class AttachDown(_message.Message):
    __slots__ = ("conn_id", "splice_port", "splice_secret")
    CONN_ID_FIELD_NUMBER: _ClassVar[int]
    SPLICE_PORT_FIELD_NUMBER: _ClassVar[int]
    SPLICE_SECRET_FIELD_NUMBER: _ClassVar[int]
    conn_id: int
    splice_port: int
    splice_secret: bytes
    def __init__(self, conn_id: _Optional[int] = ..., splice_port: _Optional[int] = ..., splice_secret: _Optional[bytes] = ...) -> None: ...
