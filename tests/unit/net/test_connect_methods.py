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
