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


def test_visible_text_holds_back_a_possible_stop_prefix(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("###",))
    feed(detok, tok.encode("answer #"))
    assert detok.text.endswith("#")
    assert detok.visible_text(finished=False) == detok.text[:-1]
    assert detok.visible_text(finished=True) == detok.text


def test_special_tokens_are_skipped_or_kept(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("hi") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    feed(skip, ids)
    feed(keep, ids)
    assert skip.text == "hi" and keep.text == "hi" + tok.eos_token
