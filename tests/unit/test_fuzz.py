"""Property tests (hypothesis, bounded examples): arbitrary input to each parser of outside data
gives a value or the module's own error type, never another exception.

- the critic's score-request parser: BadRequest;
- the grid codec: TransportError (arbitrary frames, and valid frames with bytes flipped);
- the config loader (YAML text and KEY=VALUE overrides): ConfigError;
- the value-pretraining JSONL reader: PretrainDataError.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.config import ConfigError, load_config
from megatron_rl.critic.pretrain import PretrainDataError, read_pretrain_jsonl
from megatron_rl.critic.service import BadRequest, parse_score_request
from megatron_rl.transport.codec import TransportError, decode_grid_item, encode_grid_item
from tests.support.configs import base
from tests.support.samples import make_grid

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def nested_values(integers):
    """JSON-like values (nested lists and dicts) whose integers are drawn from `integers`."""
    return st.recursive(
        st.none() | st.booleans() | integers | st.floats(allow_nan=True) | st.text(max_size=8),
        lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=30,
    )


json_values = nested_values(st.integers(-(2**70), 2**70))
msgpack_values = nested_values(st.integers(-(2**63), 2**64 - 1))  # what the grid's msgpack header can hold
request_like = st.dictionaries(
    st.sampled_from(["batched_token_ids", "token_ids", "x"]),
    json_values | st.lists(st.lists(st.integers(-5, 120), max_size=20), max_size=6),
    max_size=2,
)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                 request_like.map(lambda v: json.dumps(v).encode())))  # fmt: skip
def test_score_request_parser(body):
    try:
        sequences, legacy = parse_score_request(body, vocab_size=100, seq_len=16, max_batch_sequences=4)
    except BadRequest:
        return
    assert 1 <= len(sequences) <= 4 and all(1 <= len(s) <= 16 and all(0 <= t < 100 for t in s) for s in sequences)
    assert isinstance(legacy, bool)


FRAMES = [bytes(f) for f in encode_grid_item(3, 0, make_grid(3, 1)[0])]


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_grid_codec_arbitrary_frames(frames):
    try:
        decode_grid_item(frames, "fuzz", 3, 0, vocab_size=50_000)
    except TransportError:
        pass


@FUZZ
@given(st.integers(0, len(FRAMES) - 1), st.data())
def test_grid_codec_flipped_bytes_and_edited_headers(index, data):
    frames = list(FRAMES)
    if index == 0:  # a header that still decodes, with one value replaced
        header = msgspec.msgpack.decode(frames[0])
        key = data.draw(st.sampled_from(sorted(header)))
        header[key] = data.draw(msgpack_values)
        frames[0] = msgspec.msgpack.encode(header)
    else:
        frame = bytearray(frames[index])
        if frame:
            position = data.draw(st.integers(0, len(frame) - 1))
            frame[position] ^= data.draw(st.integers(1, 255))
        frames[index] = bytes(frame)
    try:
        micro_batches = decode_grid_item(frames, "fuzz", 3, 0, vocab_size=50_000)
    except TransportError:
        return
    assert index == 0  # a flipped data byte never passes the checksum
    assert all(np.isfinite(mb.advantages).all() for mb in micro_batches)


@FUZZ
@given(st.one_of(st.text(max_size=300), json_values.map(json.dumps)),
       st.lists(st.text(max_size=30), max_size=3))  # fmt: skip
def test_config_loader_arbitrary_yaml_and_overrides(tmp_path_factory, text, overrides):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(text)
    try:
        load_config(path, overrides)
    except ConfigError:
        pass


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["model", "algorithm", "orchestrator", "deployment", "inference"]),
                          st.text(min_size=1, max_size=12), json_values), max_size=4))  # fmt: skip
def test_config_loader_near_valid_configs(tmp_path_factory, edits):
    data = base()
    for section, key, value in edits:
        data.setdefault(section, {})
        if isinstance(data[section], dict):
            data[section][key] = value
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(json.dumps(data, allow_nan=True))
    try:
        load_config(path)
    except ConfigError:
        pass


near_valid_line = st.integers(1, 8).flatmap(lambda n: st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(0, 31), min_size=n, max_size=n), "loss_mask": st.just([1] * n)},
    optional={"reward": st.floats(allow_nan=True), "returns": st.lists(st.floats(allow_nan=True), min_size=n,
                                                                       max_size=n)},
)).map(lambda d: json.dumps(d))  # fmt: skip
pretrain_line = st.one_of(
    near_valid_line,
    json_values.map(json.dumps),
    st.fixed_dictionaries(
        {"token_ids": st.lists(st.integers(-2, 40), max_size=10)},
        optional={"loss_mask": st.lists(json_values, max_size=10), "reward": json_values,
                  "returns": st.lists(st.floats(allow_nan=True) | st.integers(), max_size=10)},  # fmt: skip
    ).map(json.dumps),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)


@FUZZ
@given(st.lists(pretrain_line, max_size=4))
def test_pretrain_jsonl_reader(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    path.write_bytes("\n".join(line.replace("\n", " ") for line in lines).encode("utf-8", "surrogatepass"))
    try:
        samples = read_pretrain_jsonl(path, vocab_size=32, seq_len=8)
    except PretrainDataError:
        return
    for sample in samples:
        assert np.isfinite(sample.returns).all() and sample.loss_mask.any()
