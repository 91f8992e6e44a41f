"""KV groups with sliding windows (Gemma 3's layout): a window group gives back blocks the window
has passed, a prefix hit needs every global block and only the window's blocks before it, and an
8k-token Gemma 3 sequence holds under a quarter of what a window-blind cache would."""

from octavo.config import KVGroup, ModelConfig, RopeConfig, blocks_to_hold
from octavo.kv_cache.manager import NULL_BLOCK_ID, KVCacheManager
from octavo.request import Request
from tests.helpers import make_request

BS = 4


def advance(kv: KVCacheManager, req: Request, num_tokens: int) -> list[list[int]]:
    """Schedule and 'compute' the request's next `num_tokens` tokens (one chunk); its tables."""
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return kv.block_tables(req.request_id)


def test_a_window_group_gives_back_blocks_the_window_has_passed():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 6))
    req = make_request("a", 30, max_tokens=10)
    advance(kv, req, 10)  # tokens 0-9: both groups hold 3 blocks (the chunk's queries read token 0)
    assert kv.num_free_blocks == 40 - 6
    # tokens 10-13: the first query (10) reads keys 5.. : the window group gives back block 0
    first_local = kv.block_tables("a")[1][0]
    _, local = advance(kv, req, 4)
    assert local[0] == NULL_BLOCK_ID and first_local not in kv.view().held_blocks("a")
    assert kv.num_free_blocks == 40 - 4 - 3
    for _ in range(16):  # to 30 tokens a token at a time: the window group keeps 2 or 3 blocks
        advance(kv, req, 1)
        assert len(kv.view().held_blocks("a")) - -(-req.num_computed_tokens // BS) in (2, 3)
    assert len(kv.block_tables("a")[0]) == 8 and kv.view().check_invariants() == []
    kv.remove(req)
    assert kv.num_free_blocks == 40


def test_a_prefix_hit_needs_global_blocks_and_only_the_window_before_it():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 6))
    a = make_request("a", list(range(30)))
    advance(kv, a, 30)
    kv.free(a)  # its blocks stay cached (evictable)
    b = make_request("b", list(range(24)) + [99, 98, 97, 96])  # shares 24 tokens = 6 blocks
    hit = kv.get_computed_blocks(b)
    assert hit.num_blocks == 6
    full, local = hit.groups
    assert None not in full
    # the next token (24) reads keys 19..23: blocks 4 and 5 of the window group, not 0-3 (a
    # gave those back while it ran; they are in the cache anyway, unneeded)
    assert local[:4] == [None] * 4 and None not in local[4:]
    alloc = kv.allocate_slots(b, 4, hit)
    assert alloc.block_tables[1][:4] == [NULL_BLOCK_ID] * 4
    assert kv.view().check_invariants() == []


def test_a_hit_shortens_to_where_the_window_blocks_are_still_cached():
    kv = KVCacheManager(num_blocks=12, block_size=BS, group_windows=(None, 6))
    a = make_request("a", list(range(24)))
    advance(kv, a, 20)
    advance(kv, a, 4)  # its window group gave back blocks 0-3 (tokens 0-15)
    kv.free(a)
    evict = make_request("x", 12)  # takes the free blocks at the queue's front: a's uncached tail
    advance(kv, evict, 12)
    assert kv.allocate_slots(make_request("y", 7), 7) is not None  # and more: now cached blocks go
    b = make_request("b", list(range(24)) + [99])
    hit = kv.get_computed_blocks(b)
    full, local = hit.groups or ([], [])
    # whatever survived, a hit of n blocks holds a full chain of global blocks and the window's
    n = hit.num_blocks
    assert len(full) == n and None not in full
    needed = max(0, n * BS - 6 + 1) // BS
    assert None not in local[needed:n]
    assert n < 6  # not all of a's window blocks survived the evictions


def test_one_8k_gemma3_sequence_holds_under_a_quarter_of_a_window_blind_cache():
    cfg = ModelConfig("Gemma3ForCausalLM", 262144, 640, 2048, 18, 4, 1, 256, 1e-6, RopeConfig(1e6), 32768,
                      sliding_window=512, layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18)))
    groups = cfg.kv_groups()
    assert groups[0] == KVGroup(None, (5, 11, 17)) and len(groups) == 6
    assert {g.window for g in groups[1:]} == {512} and cfg.kv_bytes_per_block(16, "float32") == 3 * 2 * 16 * 256 * 4
    windows = tuple(g.window for g in groups)
    kv = KVCacheManager(num_blocks=4000, block_size=16, group_windows=windows)
    req = make_request("long", 8192 - 64, max_tokens=64)
    for _ in range(4):  # chunked prefill, 2,032 tokens a step, then decodes
        advance(kv, req, 2032)
    while req.num_computed_tokens < 8192:
        req.output_token_ids.append(7)  # the token sampled last step, computed now
        req.all_token_ids.append(7)
        advance(kv, req, 1)
    held = len(kv.view().held_blocks("long"))
    blind = 6 * 8192 // 16
    # every global block; per window group the 32 blocks of the last 512 tokens (33 mid-block)
    assert 512 + 5 * 32 <= held <= 512 + 5 * 33
    assert held / blind < 0.25 and abs(held / blind - 0.22) < 0.005
    assert held <= blocks_to_hold(windows, 8192, 16, 2032)


def test_a_short_convolution_group_is_its_own_kind_with_a_window_of_its_kernel():
    """LFM2's conv layers: a "conv" group (ShortConvState) keeps the blocks of its last `kernel`
    positions, gives back the rest as a window does, and a prefix hit restores its state only with
    the blocks of the kernel - 1 positions before the hit (the state is those slots)."""
    from octavo.kv_cache.groups import ShortConvState

    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 3), group_kinds=("attention", "conv"))
    assert type(kv.groups[1]) is ShortConvState and kv.groups[1].kind == "conv"
    a = make_request("a", list(range(30)))
    advance(kv, a, 10)
    for _ in range(20):  # a token at a time: the conv group holds the blocks of 3 positions, 1 or 2
        advance(kv, a, 1)
        held_conv = len(kv.view().held_blocks("a")) - -(-a.num_computed_tokens // BS)
        assert held_conv in (1, 2)
    kv.free(a)
    b = make_request("b", list(range(24)) + [7, 7])
    hit = kv.get_computed_blocks(b)
    full, conv = hit.groups
    assert hit.num_blocks == 6 and None not in full
    # the next token (24) convolves over 22 and 23: block 5 alone; a gave back the older ones
    assert conv[5] is not None and conv[:5] == [None] * 5
    assert kv.view().check_invariants() == []


def test_lfm2_layers_group_by_kind_with_conv_layers_over_whole_kv_slots():
    """ModelConfig.kv_groups for LFM2-1.2B's layout: 6 attention and 10 conv layers whose 2048
    inputs take 2 K/V pairs of 8 x 64 each: pairs of attention layers, conv layers one a group."""
    types = tuple("full" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16))
    cfg = ModelConfig("Lfm2ForCausalLM", 65536, 2048, 8192, 16, 32, 8, 64, 1e-5, RopeConfig(), 4096,
                      layer_types=types, conv_kernel=3)
    groups = cfg.kv_groups()
    assert cfg.conv_slots() == 2 and cfg.kv_slots_per_block() == 2
    assert [g.layers for g in groups if g.kind == "attention"] == [(2, 5), (8, 10), (12, 14)]
    assert [g.layers for g in groups if g.kind == "conv"] == [(i,) for i in (0, 1, 3, 4, 6, 7, 9, 11, 13, 15)]
    assert {g.window for g in groups if g.kind == "conv"} == {3}
    odd = ModelConfig("Lfm2ForCausalLM", 65536, 2048, 8192, 4, 32, 8, 64, 1e-5, RopeConfig(), 4096,
                      layer_types=("conv", "full", "conv", "conv"), conv_kernel=3)
    try:  # 1 attention layer against 3 x 2 pairs: no common block
        odd.kv_groups()
    except ValueError as exc:
        assert "cannot share one block size" in str(exc)
    else:
        raise AssertionError("an impossible layout was accepted")
