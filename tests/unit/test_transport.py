"""Grid codec and the ZMQ sender/receiver in one process: byte-exact round trips and every error."""

from __future__ import annotations

import socket
import threading

import msgspec
import numpy as np
import pytest
import zmq

from megatron_rl.transport import (
    GridReceiver,
    GridSender,
    TransportError,
    TransportTimeout,
    decode_grid_item,
    encode_grid_item,
)
from tests.support.samples import make_grid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_micro_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.is_dummy == b.is_dummy
        for name, array in b.arrays().items():
            other = getattr(a, name)
            assert other.dtype == array.dtype and other.shape == array.shape
            assert other.tobytes() == array.tobytes(), name


def test_codec_round_trip_is_byte_exact():
    grid = make_grid(0, 2, 2)
    frames = encode_grid_item(7, 1, grid[1])
    decoded = decode_grid_item([bytes(f) for f in frames], "test", 7, 1)
    assert_same_micro_batches(decoded, grid[1])
    assert any(mb.is_dummy for row in make_grid(1, 4, count=3) for mb in row)


def test_micro_batches_carry_their_minibatch_in_order():
    row = make_grid(0, 1, count=12)[0]
    for index, mb in enumerate(row):
        mb.minibatch = min(index, 2)
    decoded = decode_grid_item([bytes(f) for f in encode_grid_item(5, 0, row)], "test", 5, 0)
    assert [mb.minibatch for mb in decoded] == [mb.minibatch for mb in row]
    assert decoded[-1].minibatch == 2
    row[0].minibatch, row[-1].minibatch = 2, 0
    with pytest.raises(TransportError, match="micro-step 1: mini-batch 1 after 2"):
        decode_grid_item([bytes(f) for f in encode_grid_item(5, 0, row)], "test", 5, 0)


def test_codec_rejects_corruption_wrong_version_and_truncation():
    grid = make_grid(0, 1)
    frames = [bytes(f) for f in encode_grid_item(3, 0, grid[0])]
    corrupt = list(frames)
    corrupt[2] = bytes([corrupt[2][0] ^ 0xFF]) + corrupt[2][1:]
    with pytest.raises(
        TransportError,
        match=r"test: grid item for step 3, data rank 0: micro-step 0 array .*checksum mismatch",
    ):
        decode_grid_item(corrupt, "test", 3, 0)
    header = msgspec.msgpack.decode(frames[0])
    header["version"] = 99
    with pytest.raises(TransportError, match="wrong format version 99"):
        decode_grid_item([msgspec.msgpack.encode(header), *frames[1:]], "test", 3, 0)
    with pytest.raises(TransportError, match="truncated message"):
        decode_grid_item(frames[:-1], "test", 3, 0)
    with pytest.raises(TransportError, match="corrupt header"):
        decode_grid_item([b"\xc1garbage", *frames[1:]], "test", 3, 0)
    with pytest.raises(TransportError, match="frame is for step 3, data rank 0"):
        decode_grid_item(frames, "test", 4, 0)
    short = list(frames)
    short[1] = short[1][:-1]
    with pytest.raises(TransportError, match="bytes, header says"):
        decode_grid_item(short, "test", 3, 0)


def test_late_receiver_gets_every_step_and_sender_releases_after_acks():
    port = free_port()
    with GridSender(
        "127.0.0.1", port, data_parallel_size=2, receivers_per_data_rank=1, max_pending_steps=3
    ) as sender:
        grids = {step: make_grid(step, 2) for step in range(3)}
        for step, grid in grids.items():
            sender.publish(step, grid)  # nobody is connected yet: nothing may be lost
        receivers = [GridReceiver("127.0.0.1", port, data_rank=d, timeout_s=10) for d in range(2)]
        sender.wait_for_receivers(timeout_s=10)
        for step, grid in grids.items():
            for d, receiver in enumerate(receivers):
                assert_same_micro_batches(receiver.receive(step), grid[d])
            sender.wait_delivered(step, timeout_s=10)
        with pytest.raises(TransportError, match="step 0 was already delivered and released"):
            receivers[0].receive(0)
        for receiver in receivers:
            receiver.close()


def test_unacknowledged_step_is_kept_and_served_again():
    port = free_port()
    with GridSender("127.0.0.1", port, data_parallel_size=1) as sender:
        grid = make_grid(5, 1)
        sender.publish(5, grid)
        # A receiver that takes the data but dies before acknowledging it.
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.send_multipart([b"GET", msgspec.msgpack.encode({"step": 5, "data_rank": 0, "receiver_id": 0})])
        assert raw.poll(10_000) and raw.recv_multipart()[0] == b"DATA"
        raw.close(linger=0)
        with pytest.raises(
            TransportTimeout,
            match=r"step 5 not acknowledged within 0.3s by \(data rank, receiver\) \[\(0, 0\)\]",
        ):
            sender.wait_delivered(5, timeout_s=0.3)
        with GridReceiver("127.0.0.1", port, data_rank=0, timeout_s=10) as receiver:
            assert_same_micro_batches(receiver.receive(5), grid[0])
        sender.wait_delivered(5, timeout_s=10)


def fake_sender(port: int, replies: list[list[bytes]], stop: threading.Event):
    """A ROUTER that answers HELLO and then each GET with the next prepared (bad) reply."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    pending = list(replies)
    while not stop.is_set():
        if not sock.poll(20):
            continue
        identity, kind, _ = sock.recv_multipart()
        if kind == b"HELLO":
            sock.send_multipart(
                [identity, b"WELCOME", msgspec.msgpack.encode({"name": "fake", "data_parallel_size": 1})]
            )
        elif kind == b"GET" and pending:
            sock.send_multipart([identity, *pending.pop(0)])
    sock.close(linger=0)


def test_receiver_raises_on_corrupt_and_wrong_version_frames():
    grid = make_grid(2, 1)
    frames = [bytes(f) for f in encode_grid_item(2, 0, grid[0])]
    corrupt = list(frames)
    corrupt[3] = b"\x00" * len(corrupt[3])
    header = msgspec.msgpack.decode(frames[0])
    header["version"] = 1  # the format before micro-batches carried their mini-batch
    meta = msgspec.msgpack.encode({"step": 2, "data_rank": 0})
    port, stop = free_port(), threading.Event()
    thread = threading.Thread(
        target=fake_sender,
        args=(
            port,
            [[b"DATA", meta, *corrupt], [b"DATA", meta, msgspec.msgpack.encode(header), *frames[1:]]],
            stop,
        ),
    )
    thread.start()
    try:
        with GridReceiver("127.0.0.1", port, data_rank=0, timeout_s=10) as receiver:
            with pytest.raises(
                TransportError, match=f"tcp://127.0.0.1:{port}: grid item for step 2.*checksum mismatch"
            ):
                receiver.receive(2)
            with pytest.raises(TransportError, match="wrong format version 1"):
                receiver.receive(2)
            with pytest.raises(
                TransportTimeout,
                match=f"tcp://127.0.0.1:{port}: no answer to step 2 for data rank 0 within 0.2s",
            ):
                receiver.receive(2, timeout_s=0.2)
    finally:
        stop.set()
        thread.join()


def test_handshake_timeout_and_layout_errors_name_the_endpoint():
    port = free_port()
    with pytest.raises(TransportTimeout, match=f"tcp://127.0.0.1:{port}: no answer to handshake"):
        GridReceiver("127.0.0.1", port, data_rank=0, handshake_timeout_s=0.2)
    with GridSender("127.0.0.1", port, data_parallel_size=2) as sender:
        with pytest.raises(
            TransportError, match=r"data rank 2 / receiver 0 outside this sender's layout \(dp 2"
        ):
            GridReceiver("127.0.0.1", port, data_rank=2, handshake_timeout_s=5)
        with pytest.raises(ValueError, match="grid has 1 data ranks, expected 2"):
            sender.publish(0, make_grid(0, 1))
        with pytest.raises(TransportTimeout, match="0 of 2 receivers connected"):
            sender.wait_for_receivers(timeout_s=0.2)


def test_sender_survives_malformed_requests_and_keeps_serving(caplog):
    """Missing / non-integer / boolean step, undecodable payload, unknown fields and kinds, wrong
    frame count and an oversized message: each is answered with ERROR or dropped, logged with the
    peer, and the sender still delivers to a well-behaved receiver afterwards."""
    port = free_port()
    pack = msgspec.msgpack.encode
    who = {"data_rank": 0, "receiver_id": 0}
    bad = [
        [b"GET", pack(who)],  # no step
        [b"ACK", pack({**who, "step": "five"})],
        [b"GET", pack({**who, "step": True})],
        [b"GET", pack({**who, "step": 1.5})],
        [b"GET", b"\xc1 not msgpack"],
        [b"GET", pack([1, 2, 3])],
        [b"GET", pack({**who, "step": 5, "extra": 1})],
        [b"HELLO", pack({"data_rank": "zero", "receiver_id": 0})],
        [b"STEAL", pack({**who, "step": 5})],
        [b"GET"],  # one frame short
        [b"GET", pack({**who, "step": 5}), b"surplus"],
    ]
    with GridSender("127.0.0.1", port, data_parallel_size=1) as sender:
        grid = make_grid(5, 1)
        sender.publish(5, grid)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{port}")
        errors = 0
        with caplog.at_level("WARNING"):
            for message in bad:
                raw.send_multipart(message)
                if raw.poll(300):
                    kind, payload = raw.recv_multipart()
                    assert kind == b"ERROR", kind
                    errors += 1
            huge = zmq.Context.instance().socket(zmq.DEALER)  # over MAX_REQUEST_BYTES: ZMQ drops the peer
            huge.connect(f"tcp://127.0.0.1:{port}")
            huge.send_multipart([b"GET", b"x" * (2 * 1024 * 1024)])
            assert not huge.poll(300)
            huge.close(linger=0)
        assert errors == 9  # the two wrong-frame-count messages are dropped without a reply
        assert "malformed GET request from peer" in caplog.text and "unknown request kind" in caplog.text
        raw.close(linger=0)
        with GridReceiver("127.0.0.1", port, data_rank=0, timeout_s=10) as receiver:
            assert_same_micro_batches(receiver.receive(5), grid[0])
        sender.wait_delivered(5, timeout_s=10)
        sender.publish(6, make_grid(6, 1))  # the sender thread is alive and accepts more


def reencoded(grid_row, edit):
    """Frames for a micro-batch row after `edit(arrays)` changed its arrays (checksums recomputed,
    so only the content is wrong)."""
    from dataclasses import replace

    rows = []
    for mb in grid_row:
        arrays = {k: v.copy() for k, v in mb.arrays().items()}
        edit(arrays)
        rows.append(replace(mb, **arrays))
    return [bytes(f) for f in encode_grid_item(3, 0, rows)]


def drop(name):
    def edit(arrays):
        del arrays[name]

    return edit


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda a: a.update(returns=a["returns"][:-1]), "array returns: .* entries, input_ids has"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"] + 1), "array cu_seqlens: .* must start at 0"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"][::-1].copy()), "array cu_seqlens"),
        (lambda a: a.update(cu_seqlens=np.append(a["cu_seqlens"], 10_000).astype(np.int32)), "array cu_seqlens: .*end within the row"),
        (lambda a: a["position_ids"].__setitem__(1, 7), "array position_ids: token 1 has position 7"),
        (lambda a: a["input_ids"].__setitem__(0, 50_000), r"array input_ids: ids .*outside the vocabulary 0..49999"),
        (lambda a: a["input_ids"].__setitem__(0, -4), "array input_ids"),
        (lambda a: a["loss_mask"].view(np.uint8).__setitem__(2, 7), "array loss_mask: values other than 0/1"),
        (lambda a: a["advantages"].__setitem__(0, np.nan), "array advantages: non-finite"),
        (lambda a: a["inference_logprobs"].__setitem__(0, -np.inf), "array inference_logprobs: non-finite"),
        (lambda a: a.update(old_values=a["old_values"].astype(np.float64)), "array old_values: unexpected dtype 'float64'"),
        (lambda a: a.update(input_ids=a["input_ids"].reshape(1, -1)), "array input_ids: impossible shape"),
    ],
)
def test_codec_rejects_frames_that_cannot_be_a_packed_row(edit, message):
    """Every such frame raises TransportError naming endpoint, step and array before any tensor
    reaches a model."""
    frames = reencoded(make_grid(3, 1)[0], edit)
    with pytest.raises(TransportError, match=r"test: grid item for step 3, data rank 0: micro-step 0 " + message):
        decode_grid_item(frames, "test", 3, 0, vocab_size=50_000)


def test_codec_rejects_missing_arrays_and_header_lies():
    frames = [bytes(f) for f in encode_grid_item(3, 0, make_grid(3, 1)[0])]
    header = msgspec.msgpack.decode(frames[0])
    specs = header["micro_batches"][0]["arrays"]
    index = next(i for i, spec in enumerate(specs) if spec["name"] == "returns")
    missing = dict(header, micro_batches=[dict(header["micro_batches"][0], arrays=specs[:index] + specs[index + 1:])]
                   + header["micro_batches"][1:])  # fmt: skip
    buffers = frames[1:]
    del buffers[index]
    with pytest.raises(TransportError, match=r"micro-step 0: arrays missing \['returns'\]"):
        decode_grid_item([msgspec.msgpack.encode(missing), *buffers], "test", 3, 0)
    lying = dict(header, micro_batches=[dict(header["micro_batches"][0], arrays=[dict(specs[0], shape=[999])] + specs[1:])]
                 + header["micro_batches"][1:])  # fmt: skip
    with pytest.raises(TransportError, match="impossible shape"):
        decode_grid_item([msgspec.msgpack.encode(lying), *frames[1:]], "test", 3, 0)
    for bad in (dict(header, step="3"), dict(header, micro_batches="x"), dict(header, extra=1), [1, 2]):
        with pytest.raises(TransportError, match="test: grid item for step 3"):
            decode_grid_item([msgspec.msgpack.encode(bad), *frames[1:]], "test", 3, 0)


def teacher_top_k_row(step: int = 3):
    """make_grid's first row and a dummy, with a teacher's top k (K = 5) on every real
    micro-batch: on action tokens random ids of a vocabulary of 50,000 and decreasing negative
    log-probabilities, ids 0 and log-probabilities 0 elsewhere."""
    from megatron_rl.data.packing import dummy_micro_batch

    row = make_grid(step, 1)[0] + [dummy_micro_batch()]
    rng = np.random.default_rng(step)
    for mb in row:
        if not mb.is_dummy:
            action = mb.loss_mask[:, None]
            logprobs = -np.cumsum(rng.exponential(size=(mb.num_tokens, 5)), axis=1)
            mb.teacher_top_ids = np.where(action, rng.integers(0, 50_000, (mb.num_tokens, 5)), 0).astype(np.int32)
            mb.teacher_top_logprobs = np.where(action, logprobs, 0.0).astype(np.float32)
    return row


def test_codec_round_trip_of_the_teachers_top_k_is_byte_exact():
    row = teacher_top_k_row()
    assert row[-1].is_dummy and row[-1].teacher_top_ids is None and not row[0].is_dummy
    decoded = decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, row)], "test", 3, 0, vocab_size=50_000)
    assert_same_micro_batches(decoded, row)
    assert all(mb.teacher_top_ids.shape == (mb.num_tokens, 5) for mb in decoded if not mb.is_dummy)
    assert all(mb.teacher_top_ids is None for mb in decode_grid_item(
        [bytes(f) for f in encode_grid_item(3, 0, make_grid(3, 1)[0])], "test", 3, 0))  # fmt: skip


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda a: a.update(teacher_top_logprobs=None), r"arrays missing \['teacher_top_logprobs'\]"),
        (lambda a: a.update(teacher_top_ids=None), r"arrays missing \['teacher_top_ids'\]"),
        (lambda a: a.update(teacher_top_ids=a["teacher_top_ids"].astype(np.int64)),
         "array teacher_top_ids: unexpected dtype 'int64' .expected int32"),
        (lambda a: a.update(teacher_top_logprobs=a["teacher_top_logprobs"].astype(np.float64)),
         "array teacher_top_logprobs: unexpected dtype 'float64'"),
        (lambda a: a.update(teacher_top_ids=a["teacher_top_ids"][:, 0].copy()), "array teacher_top_ids: impossible shape"),
        (lambda a: a.update(teacher_top_logprobs=a["teacher_top_logprobs"][None]), "array teacher_top_logprobs: impossible shape"),
        (lambda a: a.update(teacher_top_ids=a["teacher_top_ids"][:-1]), "array teacher_top_ids: .* entries, input_ids has"),
        (lambda a: a.update(teacher_top_logprobs=a["teacher_top_logprobs"][:, :3].copy()),
         "array teacher_top_logprobs: 3 columns, teacher_top_ids has 5"),
        (lambda a: a.update(teacher_top_ids=a["teacher_top_ids"][:, :0].copy(),
                            teacher_top_logprobs=a["teacher_top_logprobs"][:, :0].copy()),
         "array teacher_top_logprobs: 0 columns, teacher_top_ids has 0 .both \\[N, K\\], K >= 1"),
        (lambda a: a["teacher_top_ids"].__setitem__((1, 2), 50_000), "array teacher_top_ids: ids 0..50000 outside the vocabulary 0..49999"),
        (lambda a: a["teacher_top_ids"].__setitem__((0, 0), -1), "array teacher_top_ids: ids -1..* outside"),
        (lambda a: a["teacher_top_logprobs"].__setitem__((0, 1), np.nan), "array teacher_top_logprobs: non-finite"),
        (lambda a: a["teacher_top_logprobs"].__setitem__((2, 0), -np.inf), "array teacher_top_logprobs: non-finite"),
        (lambda a: a["teacher_top_logprobs"].__setitem__((2, 0), 0.01), "array teacher_top_logprobs: log-probability 0.01 above 0 .at most 0.0001"),
    ],
)
def test_codec_refuses_a_bad_teachers_top_k_naming_the_array(edit, message):
    frames = reencoded([teacher_top_k_row()[0]], edit)
    with pytest.raises(TransportError, match=r"test: grid item for step 3, data rank 0: micro-step 0:? " + message):
        decode_grid_item(frames, "test", 3, 0, vocab_size=50_000)


def test_codec_accepts_a_teachers_log_probability_rounded_just_above_zero():
    row = teacher_top_k_row()[:1]
    row[0].teacher_top_logprobs[0, 0] = 5e-5
    decoded = decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, row)], "test", 3, 0, vocab_size=50_000)
    assert decoded[0].teacher_top_logprobs[0, 0] == np.float32(5e-5)
