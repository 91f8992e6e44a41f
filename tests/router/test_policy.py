"""Routing policies, without servers: cache-aware follows the longest prefix a replica was sent
unless loads are uneven; round-robin alternates; least-load takes the idlest; unhealthy replicas
are skipped."""

import pytest

from octavo.router.policy import CHUNK_CHARS, Router, chunk_hashes

A = "You are a helpful assistant for the lighthouse museum. " * 8
B = "Translate the following paragraph into French, keeping names. " * 8


def test_chunk_hashes_are_a_path_shared_by_common_prefixes():
    a1, a2 = chunk_hashes(A + "question one"), chunk_hashes(A + "another question")
    common = len(A) // CHUNK_CHARS
    assert a1[:common] == a2[:common] and len(chunk_hashes("short")) == 0


def test_cache_aware_keeps_each_prefix_on_one_replica():
    r = Router(["http://a", "http://b"], "cache-aware")
    first_a = r.choose(A + "q0").replica.url
    first_b = r.choose(B + "q0").replica.url
    assert first_a != first_b  # a new prefix goes to the replica holding the least
    for i in range(1, 10):
        ca, cb = r.choose(A + f"q{i}"), r.choose(B + f"q{i}")
        assert (ca.replica.url, cb.replica.url) == (first_a, first_b)
        assert ca.matched_chars >= (len(A) // CHUNK_CHARS) * CHUNK_CHARS


def test_uneven_load_overrides_the_cache():
    r = Router(["http://a", "http://b"], "cache-aware", balance_abs=2)
    home = r.choose(A).replica
    home.in_flight = 10
    assert r.choose(A + "more").replica is not home


def test_round_robin_and_least_load():
    rr = Router(["http://a", "http://b"], "round-robin")
    assert [rr.choose(A).replica.url for _ in range(4)] == ["http://a", "http://b", "http://a", "http://b"]
    ll = Router(["http://a", "http://b", "http://c"], "least-load")
    ll.replicas[0].in_flight, ll.replicas[1].in_flight, ll.replicas[2].in_flight = 3, 1, 2
    assert ll.choose(A).replica.url == "http://b"


def test_unhealthy_and_excluded_replicas_are_skipped():
    r = Router(["http://a", "http://b"], "cache-aware")
    home = r.choose(A).replica
    home.healthy = False
    assert r.choose(A).replica is not home
    assert r.choose(A, exclude={"http://a", "http://b"}) is None
    with pytest.raises(ValueError, match="policy must be one of"):
        Router(["http://a"], "random")


def test_prompt_cache_key_keeps_a_key_on_one_replica_whatever_the_text():
    r = Router(["http://a", "http://b"], "cache-aware")
    home = r.choose(A + "q", key="tenant-1").replica
    # different texts (each would otherwise go to the replica holding the least) follow the key
    assert {r.choose(f"unrelated prompt {i} " * 20, key="tenant-1").replica.url for i in range(6)} == {home.url}
    assert r.choose(B, key="tenant-2").replica is not home  # a new key: chosen as usual (the emptier replica)
    home.in_flight = 100  # uneven loads win over the key, as over a prefix match
    r.balance_abs = 2
    assert r.choose(A + "q", key="tenant-1").replica is not home
    home.in_flight, home.healthy = 0, False
    assert r.choose(A + "q", key="tenant-1").replica is not home


def _stored(hashes, parent=None, tokens=(), medium="GPU", group=0):
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": list(tokens),
            "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": group}


def test_the_kv_index_follows_stores_removals_and_clears_in_both_layouts():
    from octavo.router.kv_index import KVBlockIndex

    idx = KVBlockIndex()
    idx.apply("a", [_stored([1, 2, 3]), _stored([3], medium="DISK"), _stored([9], group=1)])
    assert idx.match("a", [1, 2, 3, 4]) == 3 and idx.match("a", [9]) == 0  # another group's blocks do not count
    idx.apply("a", [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}])
    assert idx.match("a", [1, 2, 3]) == 3  # still in the tier
    idx.apply("a", [["BlockRemoved", [3], "DISK", 0], ["BlockRemoved", [2], "GPU", 0]])  # the array layout
    assert idx.match("a", [1, 2, 3]) == 1 and idx.num_blocks("a") == 1
    idx.apply("a", [["AllBlocksCleared"], ["BlockStored", [b"\x00" * 24 + (7).to_bytes(8, "big")], None, [], 0, None,
                                            "GPU", None, None, 0]])
    assert idx.match("a", [1]) == 0 and idx.match("a", [7]) == 1  # raw hashes meet the integer form
    assert idx.match("b", [7]) == 0


def test_the_kv_index_notices_a_replica_hashing_otherwise():
    from octavo.router.kv_index import KVBlockIndex, PromptHasher

    hasher = PromptHasher(16)
    tokens = list(range(32))
    idx = KVBlockIndex(hasher)
    idx.apply("good", [_stored(hasher.hashes(tokens), None, tokens)])
    idx.apply("bad", [_stored([11, 12], None, tokens)])  # e.g. a replica left on sha256 (pickle)
    assert idx.disagreeing() == ["bad"] and idx.match("good", hasher.hashes(tokens + [1] * 16)) == 2


def test_kv_events_routing_follows_the_blocks_the_replicas_report():
    from octavo.router.kv_index import KVBlockIndex

    idx = KVBlockIndex()
    r = Router(["http://a", "http://b"], "kv-events", kv_index=idx)
    idx.apply("http://b", [_stored([1, 2, 3, 4])])
    assert r.choose("any text", blocks=[1, 2, 3, 4, 5]).replica.url == "http://b"  # the text plays no part
    first = r.choose("", blocks=[50, 51, 52]).replica.url  # nowhere: the replica holding the fewest blocks
    assert first == "http://a" and r.choose("", blocks=[50, 51, 52, 53]).replica.url == "http://a"  # sent, not yet stored
    idx.apply("http://b", [_stored([60, 61])])
    idx.apply("http://b", [{"type": "AllBlocksCleared"}])
    assert r.choose("", blocks=[60, 61]).matched_blocks == 0  # b dropped them: no pull towards b
    with pytest.raises(ValueError, match="index"):
        Router(["http://a"], "kv-events")
