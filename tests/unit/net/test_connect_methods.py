"""The stage clients' method tables come from the service descriptor: every method the proto declares is
callable, over gRPC and in-process, with its streaming shape, and nothing else is."""

from __future__ import annotations

import grpc
import pytest

from swarm.net.connect import LocalNetwork, StageClient, status_of
from swarm.net.stream import METHODS, bind_method
from swarm.proto import stage_pb2

pytestmark = pytest.mark.timeout(30)


def test_the_tables_follow_the_descriptor():
    declared = {m.name for m in stage_pb2.DESCRIPTOR.services_by_name["Stage"].methods}
    assert set(METHODS) == declared
    # the typed interface callers see names the same methods
    protocol = {n for n in vars(StageClient) if not n.startswith("_")}
    assert protocol == declared
    assert {n for n, m in METHODS.items() if m.client_streaming} == {"Forward", "Backward", "Sink", "Average"}
    assert {n for n, m in METHODS.items() if m.server_streaming} == {"GetState"}


class _Channel:
    """Records how each method is bound."""

    def __init__(self):
        self.bound = {}

    def _factory(kind):
        def bind(self, path, request_serializer=None, response_deserializer=None):
            self.bound[path] = (kind, request_serializer, response_deserializer)
            return path

        return bind

    unary_unary, unary_stream = _factory("unary_unary"), _factory("unary_stream")
    stream_unary, stream_stream = _factory("stream_unary"), _factory("stream_stream")


def test_grpc_bindings_take_serialized_items_for_streams():
    channel = _Channel()
    for method in METHODS.values():
        bind_method(channel, method)
    kind, serializer, reply = channel.bound["/swarm.Stage/Forward"]
    assert (kind, serializer) == ("stream_unary", None)  # items go as they are, serialized once
    assert reply(stage_pb2.ForwardReply(loss=2.0).SerializeToString()).loss == 2.0
    kind, serializer, reply = channel.bound["/swarm.Stage/GetState"]
    assert (
        kind == "unary_stream"
        and serializer(stage_pb2.StateRequest(stage=3)) == stage_pb2.StateRequest(stage=3).SerializeToString()
    )
    assert channel.bound["/swarm.Stage/Average"][0] == "stream_unary"
    for twin in ("ForwardItem", "BackwardItem"):  # a one-item stream's unary twin takes the item as it is
        assert channel.bound[f"/swarm.Stage/{twin}"][:2] == ("unary_unary", None)
    assert channel.bound["/swarm.Stage/Status"][0] == "unary_unary"


class _Servicer:
    def __init__(self):
        self.got = []

    def Sink(self, items, context):
        self.got = list(items)
        return stage_pb2.Traffic(wire_bytes=sum(i.ByteSize() for i in self.got))

    def Probe(self, request, context):
        self.got = [request]
        return stage_pb2.ProbeReply(payload=b"x" * request.reply_bytes)

    def Status(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "not serving")


def test_local_calls_parse_stream_items_and_pass_unary_requests():
    servicer, network = _Servicer(), LocalNetwork()
    network.register("a", servicer)
    client = network.stage("a")
    item = stage_pb2.StreamItem(info=stage_pb2.CallInfo(step=4))
    assert client.Sink([item.SerializeToString()]).wire_bytes == item.ByteSize()
    assert servicer.got[0].info.step == 4  # parsed, as gRPC hands it to the servicer
    assert client.Probe(stage_pb2.ProbeRequest(reply_bytes=3)).payload == b"xxx"
    with pytest.raises(grpc.RpcError) as e:
        client.Status(stage_pb2.Empty())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(AttributeError):
        client.Missing  # noqa: B018


def test_status_of_calls_status_on_a_channel():
    from tests.unit.net.test_connect_redial import _server

    seen: list[str] = []
    server, address = _server(seen, "a")
    try:
        with grpc.insecure_channel(address) as channel:
            assert isinstance(status_of(channel, timeout_s=10), stage_pb2.StatusReply)
        assert seen == ["a"]
    finally:
        server.stop(grace=None)


def test_a_one_item_stream_goes_as_its_unary_twin():
    """Over gRPC a Forward or Backward of one item goes as its unary twin with that item: a list of one, or
    `tensor_items` of a message under one chunk, which says so once its first item is out. A message of several
    chunks, any other iterable (nothing is read ahead to tell) and every other method go as they are."""
    import torch

    from swarm.compression import CodecConfig, make_codec
    from swarm.net.connect import _one_item
    from swarm.net.stream import tensor_items

    item = lambda mb: stage_pb2.StreamItem(info=stage_pb2.CallInfo(micro_batch=mb)).SerializeToString()  # noqa: E731
    fp32 = make_codec(CodecConfig("fp32"))
    small, large = (fp32.encode(torch.randn(*shape)) for shape in ((2, 8, 16), (8, 256, 256)))  # 1 KiB, 2 MiB
    assert _one_item("Forward", [item(1)]) == ("ForwardItem", item(1))
    assert _one_item("Backward", (item(2),)) == ("BackwardItem", item(2))
    method, sent = _one_item("Forward", tensor_items(stage_pb2.CallInfo(micro_batch=5), small, 0, None))
    assert method == "ForwardItem" and stage_pb2.StreamItem.FromString(sent).info.micro_batch == 5
    method, sent = _one_item("Backward", tensor_items(stage_pb2.CallInfo(micro_batch=6), large, 0, None))
    assert method == "Backward" and len(list(sent)) == 3  # every chunk of the 2 MiB message, in order
    pulled = []

    def generator():
        for mb in (7, 8):
            pulled.append(mb)
            yield item(mb)

    method, sent = _one_item("Forward", generator())
    assert method == "Forward" and pulled == [], "an iterable that cannot say is not read ahead"
    assert [stage_pb2.StreamItem.FromString(i).info.micro_batch for i in sent] == [7, 8]
    assert _one_item("Forward", [item(1), item(2)])[0] == "Forward"
    assert _one_item("Sink", [item(1)]) == ("Sink", [item(1)]) and _one_item("Average", [item(1)])[0] == "Average"


def test_a_peer_without_the_twins_gets_streams():
    """A stage of an older version answers a twin UNIMPLEMENTED: the same item goes again as the stream it stands
    for, and every later call to that stage goes as a stream at once."""
    from concurrent.futures import ThreadPoolExecutor

    from swarm.net.connect import GrpcConnector

    reached = []

    def forward(items, context):
        reached.append(("Forward", len(list(items))))
        return stage_pb2.ForwardReply(has_loss=True, loss=2.0).SerializeToString()

    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "swarm.Stage", {"Forward": grpc.stream_unary_rpc_method_handler(forward)}
            ),
        )
    )
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    connector = GrpcConnector()
    try:
        item = stage_pb2.StreamItem(info=stage_pb2.CallInfo(step=1)).SerializeToString()
        client = connector.stage(address)
        assert client.Forward([item], timeout=10).loss == 2.0
        assert client.Forward([item], timeout=10).loss == 2.0
        assert reached == [("Forward", 1), ("Forward", 1)]
        assert client._streams_only, "the second call went as a stream at once"
    finally:
        connector.close()
        server.stop(None)
