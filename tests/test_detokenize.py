"""IncrementalDetokenizer: deltas equal one decode of the whole output, at linear cost."""
import random

import pytest

from kvxfer.serving.model.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from kvxfer.serving.server.text import TextCodec

    return TextCodec.load(None).tokenizer


def _stream(tok, ids, stops=()):
    d, out = IncrementalDetokenizer(tok, stops), ""
    grown = []
    for i, t in enumerate(ids):
        grown.append(t)
        out += d.update(grown, final=i == len(ids) - 1)
        if d.stopped:
            break
    assert out == d.text
    return out


def test_deltas_equal_the_whole_decode_with_stops_and_split_characters(tok):
    rng = random.Random(0)
    text = "Hello wörld, ünïcode 日本語 テキスト 😀 emoji. The quick brown fox jumps over the lazy dog! " * 8
    base = tok.encode(text)
    for trial in range(150):
        if trial % 3 == 0:  # random ids: stray UTF-8 continuation bytes, special tokens
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 120))]
        else:
            a = rng.randrange(len(base))
            ids = base[a:a + rng.randrange(1, 200)]
        stops = rng.choice([(), ("fox",), ("dog!", "日本"), ("\n",)])
        full = tok.decode(ids)
        cut = min((j for j in (full.find(s) for s in stops) if j >= 0), default=-1)
        assert _stream(tok, ids, stops) == (full[:cut] if cut >= 0 else full), trial


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(tok):
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode("The quick brown fox jumps over the lazy dog! " * 200)[:2000]
    assert _stream(Counting(), ids) == tok.decode(ids)
    assert sum(decoded) < 12 * len(ids)  # a whole decode each token: ~len(ids)^2 / 2
