"""/v1/embeddings, /v1/rerank and /score on the live server, through the openai client where it has
the call: float and base64 agree, token ids equal their text, a batch equals its inputs one by one,
rerank and score rank by the embeddings' cosine; --runner pooling refuses generation. (That the
vectors equal transformers' pooled hidden states is tests/oracle/test_embeddings_match_transformers.py.)"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL
from tests.server.scripted import scripted_engine, serve_in_thread

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0)


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_float_base64_tokens_and_batches(client, live_server):
    texts = ["The capital of France is Paris.", "Bananas are yellow.", "Paris is in France."]
    batch = client.embeddings.create(model=MODEL, input=texts)
    vectors = [d.embedding for d in batch.data]
    assert [d.index for d in batch.data] == [0, 1, 2] and all(len(v) == 576 for v in vectors)
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0
    one = client.embeddings.create(model=MODEL, input=texts[1]).data[0].embedding
    assert cosine(one, vectors[1]) > 0.99999
    # the SDK asks for base64 and decodes it itself (float32 little-endian) unless a format is named
    floats = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float").data[0].embedding
    raw = base64.b64decode(client.embeddings.create(model=MODEL, input=texts[0], encoding_format="base64").data[0].embedding)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-7)
    assert floats == pytest.approx(vectors[0], abs=1e-6)
    ids = httpx.post(f"{live_server.url}/tokenize", headers=HEADERS, json={"prompt": texts[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    assert cosine(by_ids, vectors[0]) > 0.99999
    assert cosine(vectors[0], vectors[2]) > cosine(vectors[0], vectors[1])  # related texts are nearer
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")


def test_rerank_and_score_rank_by_cosine(client, live_server):
    query = "Where is the Eiffel Tower?"
    docs = ["Bananas are rich in potassium.", "The Eiffel Tower is in Paris, France.", "Cats sleep a lot."]
    r = httpx.post(f"{live_server.url}/v1/rerank", headers=HEADERS,
                   json={"model": MODEL, "query": query, "documents": docs, "top_n": 2}).json()
    vectors = [d.embedding for d in client.embeddings.create(model=MODEL, input=[query, *docs]).data]
    expected = sorted(range(3), key=lambda i: -cosine(vectors[0], vectors[i + 1]))[:2]
    assert [x["index"] for x in r["results"]] == expected and r["results"][0]["document"]["text"] == docs[expected[0]]
    assert r["results"][0]["relevance_score"] == pytest.approx(cosine(vectors[0], vectors[expected[0] + 1]), abs=1e-5)
    s = httpx.post(f"{live_server.url}/score", headers=HEADERS, json={"model": MODEL, "text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in s["data"]] == [0, 1, 2]
    assert [d["score"] for d in s["data"]] == pytest.approx([cosine(vectors[0], v) for v in vectors[1:]], abs=1e-5)
    pairs = httpx.post(f"{live_server.url}/v1/score", headers=HEADERS,
                       json={"model": MODEL, "text_1": [query, docs[0]], "text_2": [docs[1], docs[0]]}).json()
    assert pairs["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)  # a text scores 1 against itself
    bad = httpx.post(f"{live_server.url}/score", headers=HEADERS, json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_pooling_runner_refuses_generation(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, "hi"), runner="pooling") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert len(client.embeddings.create(model="scripted", input="Hi").data) == 1
