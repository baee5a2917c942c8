"""Token batches on the wire: the narrowest id width, zstd when it pays, and every bound checked on the way in."""

from __future__ import annotations

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.compression import WireError
from swarm.net.stream import tokens_from_wire, tokens_to_wire
from swarm.proto import stage_pb2


@settings(max_examples=60, deadline=None)
@given(top=st.sampled_from([1, 255, 256, 65535, 65536, 2**31 - 1]), rows=st.integers(1, 6), cols=st.integers(1, 40))
def test_round_trip_in_the_narrowest_width(top, rows, cols):
    tokens = torch.randint(0, top + 1, (rows, cols))
    tokens[0, 0] = top
    batch = tokens_to_wire(tokens, torch.arange(rows))
    assert batch.width == (1 if top < 256 else 2 if top < 65536 else 4)
    back, ids = tokens_from_wire(stage_pb2.TokenBatch.FromString(batch.SerializeToString()), top + 1, 64)
    assert torch.equal(back, tokens) and ids.tolist() == list(range(rows))


def test_text_is_a_byte_per_token_and_compresses():
    text = b"the quick brown fox jumps over the lazy dog. " * 40
    tokens = torch.tensor(list(text[: 8 * 128]), dtype=torch.long).view(8, 128)
    batch = tokens_to_wire(tokens)
    assert batch.width == 1 and batch.zstd and len(batch.tokens) < tokens.numel() // 4  # int32 was 4 per token
    assert torch.equal(tokens_from_wire(batch, 256, 128)[0], tokens)


def test_negative_ids_travel_as_they_are_and_are_refused():
    batch = tokens_to_wire(torch.tensor([[3, -1, 5]]))
    assert batch.width == 4  # never wrapped into a valid unsigned id
    with pytest.raises(WireError, match=r"tokens\.tokens"):
        tokens_from_wire(batch, 256, 8)


def test_old_int32_batches_still_read():
    tokens = torch.tensor([[1, 2, 3]])
    batch = stage_pb2.TokenBatch(shape=[1, 3], tokens=tokens.to(torch.int32).numpy().tobytes())
    assert torch.equal(tokens_from_wire(batch, 256, 8)[0], tokens)


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        (stage_pb2.TokenBatch(shape=[1, 4], width=3, tokens=b"\0" * 12), "tokens.width"),
        (stage_pb2.TokenBatch(shape=[1, 4], width=1, tokens=b"\0" * 5), "tokens.tokens"),
        (stage_pb2.TokenBatch(shape=[1, 4], width=1, zstd=True, tokens=b"not zstd"), "tokens.tokens"),
        # a small frame that would inflate far past the batch's shape is refused, not inflated
        (stage_pb2.TokenBatch(shape=[1, 4], width=1, zstd=True, tokens=zstandard.compress(b"\0" * 10**6)), "tokens"),
        (stage_pb2.TokenBatch(shape=[1, 4], width=1, zstd=True, tokens=zstandard.compress(b"\0" * 3)), "tokens"),
        (stage_pb2.TokenBatch(shape=[1, 4], width=1, tokens=bytes([1, 2, 3, 200])), "tokens.tokens"),  # >= vocab
    ],
)
def test_malformed_batches_are_refused_naming_the_field(batch, field):
    with pytest.raises(WireError, match=field.replace(".", r"\.")):
        tokens_from_wire(batch, 100, 8)
