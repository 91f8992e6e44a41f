"""Incremental detokenisation: equals a full decode, never splits a UTF-8 character, cuts stop strings."""

from octavo.detokenizer import IncrementalDetokenizer

TEXT = " Grüße aus 日本! naïve café — 3.14 words,  double  spaces\nand a new line 🙂 end"


def feed(detok, ids):
    pieces = [detok.add_token(t) for t in ids]
    return pieces


def test_incremental_text_equals_full_decode_and_pieces_are_valid(smol_tokenizer):
    tok = smol_tokenizer
    prompt = tok.encode("Say something:")
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = feed(detok, ids)
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)
    # multi-byte characters really were split across tokens here, so the hold-back was exercised
    assert sum(1 for p in pieces if p == "") > 0


def test_leading_space_of_first_output_token_is_kept(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    feed(detok, tok.encode(" world"))
    assert detok.text == " world"


def test_stop_string_is_cut_even_across_tokens(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("STOP HERE",))
    feed(detok, tok.encode("some text STOP HERE and more"))
    assert detok.text == "some text " and detok.stop_reason == "STOP HERE"
    kept = IncrementalDetokenizer(tok, [], stop=("STOP",), include_stop_str_in_output=True)
    feed(kept, tok.encode("abc STOP def"))
    assert kept.text == "abc STOP"


def test_visible_text_holds_back_the_longest_stop_minus_one(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("###", "x"))
    feed(detok, tok.encode("answer #"))
    assert detok.text == "answer #"
    assert detok.visible_text(finished=False) == "answer"  # a fixed 2 = len("###") - 1 characters
    assert detok.visible_text(finished=True) == detok.text


def test_deltas_concatenate_to_the_text_with_and_without_stops(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode(TEXT)
    for stop in ((), ("spaces\nand",), ("zzz-never",)):
        detok = IncrementalDetokenizer(tok, [], stop=stop)
        deltas = []
        for t in ids:
            detok.add_token(t)
            deltas.append(detok.take_delta(finished=False))
        deltas.append(detok.take_delta(finished=True))
        assert "".join(deltas) == detok.text
        assert detok.text == (TEXT[: TEXT.index(stop[0])] if stop == ("spaces\nand",) else tok.decode(ids))


def test_held_tail_stays_bounded_on_a_long_output(smol_tokenizer):
    # Before, every token re-scanned the text for stop prefixes and copied it whole: O(L^2).
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("never appears " * 4,))
    piece = tok.encode(" word")
    for _ in range(4000):
        detok.add_token(piece[0])
        assert len(detok._pending) <= len("never appears " * 4) - 1
        detok.take_delta(finished=False)
    assert len(detok.text) == 4000 * len(" word")


def test_invalid_utf8_forever_does_not_grow_the_window(smol_tokenizer):
    tok = smol_tokenizer
    byte_token = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    detok = IncrementalDetokenizer(tok, [])
    for _ in range(100):
        detok.add_token(byte_token)
        assert len(detok._ids) - detok._prefix_offset <= 2 * 8 + 5
    assert detok.text.count("\ufffd") >= 50


def test_special_tokens_are_skipped_or_kept(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("hi") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    feed(skip, ids)
    feed(keep, ids)
    assert skip.text == "hi" and keep.text == "hi" + tok.eos_token
