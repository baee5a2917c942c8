"""Issue 28 papercut: a stage whose call to a neighbour fails because the neighbour died (UNAVAILABLE, a deadline)
logs one WARNING line naming the code, not `ERROR unexpected failure` with a traceback; any other failure of a
call of ours still logs the traceback. The caller gets the same INTERNAL error either way."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest

from swarm.net.connect import LocalRpcError
from swarm.runtime.service import StageServicer


class _Context:
    def invocation_metadata(self):
        return ()

    def is_active(self):
        return True

    def abort(self, code, details):
        raise LocalRpcError(code, details)


def guarded(code: grpc.StatusCode):
    servicer = StageServicer(None)
    servicer.host = SimpleNamespace(role=SimpleNamespace(stage=1), peer_id="p1")

    def call():
        raise LocalRpcError(code, "failed to connect to all addresses")

    with pytest.raises(LocalRpcError) as refused:
        servicer._guard(_Context(), call)
    return refused.value


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_dead_neighbour_is_one_warning_line(code, caplog):
    with caplog.at_level(logging.INFO, logger="swarm"):
        refused = guarded(code)
    assert refused.code() == grpc.StatusCode.INTERNAL
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1 and records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert code.name in records[0].getMessage() and "failed to connect" in records[0].getMessage()


def test_any_other_failure_of_a_call_of_ours_keeps_its_traceback(caplog):
    with caplog.at_level(logging.INFO, logger="swarm"):
        guarded(grpc.StatusCode.INVALID_ARGUMENT)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "unexpected failure" in errors[0].getMessage() and errors[0].exc_info is not None
