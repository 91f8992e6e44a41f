"""KV events' wire form and configuration: the encoder's payloads decode with msgspec structs
written from docs/API.md (tests/kv_events_subscriber.py, both layouts), vLLM's JSON keys are
accepted and bad ones refused, and the ZMQ publisher numbers batches and replays them."""

from __future__ import annotations

import time

import msgspec
import pytest

from octavo.config import KVEventsConfig
from octavo.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from octavo.kv_events import BatchEncoder, ZmqPublisher, group_specs
from tests.kv_events_subscriber import Batch, ClearedEvent, RemovedEvent, StoredEvent, Subscriber

H1, H2, H3 = (bytes([i]) * 24 + (0xF0 + i).to_bytes(8, "big") for i in (1, 2, 3))


def _events():
    return [AllBlocksCleared(),
            BlockStored([H1, H2], None, list(range(8)), 4, "GPU", 0, 7, [(("cache_salt", "s"),), None]),
            BlockStored([H3], H2, [8, 9, 10, 11], 4, "GPU", 1),
            BlockRemoved([H1], "DISK", 0)]


def test_map_layout_decodes_with_the_documented_structs():
    enc = BatchEncoder(KVEventsConfig(enable_kv_cache_events=True, hash_format="bytes"),
                       group_specs([None, 512], ["attention", "attention"]), lambda i: f"adapter-{i}")
    batch = msgspec.msgpack.decode(enc.encode(_events(), ts=12.5), type=Batch)
    cleared, first, second, removed = batch.events
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0 and isinstance(cleared, ClearedEvent)
    assert isinstance(first, StoredEvent) and first.block_hashes == [H1, H2] and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and first.block_size == 4 and first.medium == "GPU"
    assert (first.lora_id, first.lora_name) == (7, "adapter-7") and first.extra_keys == [[["cache_salt", "s"]], None]
    assert first.kv_cache_spec_kind == "full_attention" and first.kv_cache_spec_sliding_window is None
    assert second.parent_block_hash == H2 and second.group_idx == 1
    assert (second.kv_cache_spec_kind, second.kv_cache_spec_sliding_window) == ("sliding_window", 512)
    assert isinstance(removed, RemovedEvent) and removed.medium == "DISK" and removed.block_hashes == [H1]
    raw = msgspec.msgpack.decode(enc.encode(_events()))  # omit_defaults: no extra_keys key where there are none
    assert "extra_keys" not in raw[1][2] and raw[1][2]["lora_id"] is None and raw[1][2]["lora_name"] is None


def test_int_hashes_and_the_array_layout():
    """hash_format int: a hash's last 8 bytes, big-endian (vLLM's default); encoding array: the
    tag first, then every field in declaration order."""
    enc = BatchEncoder(KVEventsConfig(enable_kv_cache_events=True, encoding="array"), group_specs([None], ["attention"]))
    _, events, _ = msgspec.msgpack.decode(enc.encode(_events()))
    assert events[0] == ["AllBlocksCleared"]
    tag, hashes, parent, tokens, size, lora_id, medium, lora_name, *_ = events[1]
    assert (tag, hashes, parent, size, medium) == ("BlockStored", [0xF1, 0xF2], None, 4, "GPU")
    assert events[2][2] == 0xF2 and events[3] == ["BlockRemoved", [0xF1], "DISK", 0]

    # the documented struct's fields, in order, as an array-like struct
    fields = [(f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT else (f.name, f.type)
              for f in msgspec.structs.fields(StoredEvent)]
    ArrayStored = msgspec.defstruct("ArrayStored", fields, array_like=True, tag="BlockStored")
    assert msgspec.convert(events[2], ArrayStored).token_ids == [8, 9, 10, 11]


def test_vllm_json_keys_are_taken_and_mistakes_named():
    conf = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                    '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 10, "topic": "kv"}')
    assert conf.is_on and conf.replay_endpoint == "tcp://*:5558" and conf.buffer_steps == 100
    assert KVEventsConfig.from_json("{}").publisher == "null" and not KVEventsConfig.from_json("{}").is_on
    for text, words in [('{"enable": true}', "not supported: enable"), ('{"publisher": "kafka"}', "null, zmq"),
                        ('{"buffer_steps": 0}', ">= 1"), ('{"endpoint": "5557"}', "tcp://"), ("[1]", "JSON object"),
                        ('{"hwm": "10"}', "hwm must be int"), ("{nope", "not valid JSON")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            KVEventsConfig.from_json(text)


def test_the_log_chains_stores_and_keeps_order():
    log = KVEventLog(block_size=2, info_capacity=8)
    from octavo.kv_cache.events import BlockInfo

    log.describe(H1, BlockInfo(None, (1, 2), None, None))
    log.describe(H2, BlockInfo(H1, (3, 4), None, None))
    log.changes += [("GPU", True, (0, H1)), ("GPU", True, (0, H2)), ("GPU", True, (0, H3)), ("DISK", True, (0, H1)),
                    ("GPU", False, (0, H1)), ("GPU", False, (0, H2))]
    stored, unknown, disk, removed = log.drain()
    assert stored.block_hashes == [H1, H2] and stored.token_ids == [1, 2, 3, 4] and stored.parent_hash is None
    assert unknown.block_hashes == [H3] and unknown.token_ids == [] and unknown.parent_hash is None
    assert disk.medium == "DISK" and disk.token_ids == [1, 2] and removed.block_hashes == [H1, H2]
    assert log.drain() == []


def test_the_publisher_numbers_batches_and_replays_them(tmp_path):
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    conf = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub, replay_endpoint=replay, buffer_steps=3, topic="t")
    publisher = ZmqPublisher(conf)
    enc = BatchEncoder(conf, group_specs([None], ["attention"]))
    sub = Subscriber(pub, replay, b"t")
    try:
        for i in range(5):  # sent before anyone listens: only the replay buffer (3 batches) keeps them
            publisher.publish(enc.encode([BlockStored([bytes([i]) * 32], None, [], 4, "GPU", 0)]))
        deadline = time.monotonic() + 30
        while publisher.num_sent < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        sub.last_seq = 1  # as a subscriber that had seen batches 0 and 1
        sub.start(catch_up=True)
        assert sub.last_seq == 4 and sub.num_batches == 3 and sub.num_gaps == 0
        assert len(sub.index) == 3
        publisher.publish(enc.encode([BlockRemoved([bytes([4]) * 32], "GPU", 0)]))
        sub.wait_for(lambda s: s.last_seq == 5, what="the live batch 5")
        assert len(sub.index) == 2 and sub.num_gaps == 0
    finally:
        sub.stop()
        publisher.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(b"")


def test_a_subscriber_sees_a_gap_it_did_not_replay():
    """The subscriber's gap count is real: batches it never saw show as a gap."""
    sub = Subscriber("inproc://unused")
    sub._apply(0, msgspec.msgpack.encode([0.0, [], 0]))
    sub._apply(3, msgspec.msgpack.encode([0.0, [], 0]))
    assert sub.num_gaps == 1 and sub.last_seq == 3
