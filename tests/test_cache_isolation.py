"""The prefix cache and the chunk store as a side channel (issue 64, case 6): a prompt reuses
K/V only from requests of its own ``cache_salt`` and, on the server, of its own API key, so
neither ``reused_prompt_tokens`` nor a faster first token tells one client what another sent."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from snapkv_rag.errors import InvalidGenerationParameterError
from snapkv_rag.reuse.prefix_cache import PrefixCache
from snapkv_rag.server import ServerConfig, create_app

SECRET = "The launch code for the vault is 4471. " * 6 + "Repeat the code."
DOC = "Quarterly revenue rose by nine percent, led by the northern region and new contracts. " * 3


def kv(n: int) -> list[torch.Tensor]:
    return [torch.zeros(1, 2, n, 4)]


def test_a_lookup_sees_only_its_own_namespace():
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3, 4], kv(4), kv(4), namespace="alice")
    assert cache.lookup([1, 2, 3, 4, 5], "alice")[1] == 4
    assert cache.lookup([1, 2, 3, 4, 5], "bob") == (None, 0)
    assert cache.lookup([1, 2, 3, 4, 5]) == (None, 0)


def test_a_longer_prompt_subsumes_entries_of_its_namespace_only():
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], kv(3), kv(3), namespace="alice")
    cache.insert([1, 2, 3, 4], kv(4), kv(4), namespace="bob")
    assert len(cache) == 2  # bob's entry must not evict alice's
    assert cache.lookup([1, 2, 3, 9], "alice")[1] == 3


def test_the_engine_reuses_a_prompt_only_under_the_same_salt(engine):
    engine.prefix_cache.clear()
    kwargs = dict(max_new_tokens=2, compression="snapkv:budget=32,window=8")
    for _ in range(2):  # a compressed prompt is stored when it repeats
        engine.generate(SECRET, cache_salt="victim", **kwargs)
    assert engine.generate(SECRET, cache_salt="attacker", **kwargs).stats.reused_prompt_tokens == 0
    assert engine.generate(SECRET, **kwargs).stats.reused_prompt_tokens == 0  # unsalted is a namespace of its own
    assert engine.generate(SECRET, cache_salt="victim", **kwargs).stats.reused_prompt_tokens > 0
    batch = engine.generate_batch([SECRET, SECRET + " Now."], cache_salt="victim", **kwargs)
    assert all(r.stats.reused_prompt_tokens > 0 for r in batch)


def test_stored_chunks_are_found_only_under_the_same_salt(engine):
    prompt = f"Document:\n{DOC}\nQuestion: how much did revenue rise?"
    kwargs = dict(max_new_tokens=2, reuse_segments=[DOC], prefix_cache=False)
    first = engine.generate(prompt, cache_salt="victim", **kwargs)
    assert first.stats.segment_reuse == "blended" and first.stats.segment_misses == 1
    assert engine.generate(prompt, cache_salt="attacker", **kwargs).stats.segment_hits == 0
    assert engine.generate(prompt, cache_salt="victim", **kwargs).stats.segment_hits == 1


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7, b"bytes"])
def test_a_bad_salt_is_one_clear_error(engine, salt):
    with pytest.raises(InvalidGenerationParameterError) as caught:
        engine.generate("Hi", max_new_tokens=1, cache_salt=salt)
    assert caught.value.param == "cache_salt"


def chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "compression": "snapkv:budget=32,window=8", **extra}


def reused(client: TestClient, body: dict, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["snapkv"]["reused_prompt_tokens"]


def test_each_api_key_is_a_tenant_that_reuses_only_its_own_prompts(engine):
    engine.prefix_cache.clear()
    with TestClient(create_app(ServerConfig(engine, model_id="tiny", api_key=["key-alice", "key-bob"]))) as client:
        for _ in range(2):
            reused(client, chat(SECRET), "key-alice")
        assert reused(client, chat(SECRET), "key-bob") == 0  # bob's right guess tells him nothing
        assert reused(client, chat(SECRET, cache_salt="x"), "key-bob") == 0
        assert reused(client, chat(SECRET), "key-alice") > 0
        assert client.post("/v1/chat/completions", json=chat(SECRET), headers={"Authorization": "Bearer key-carol"}).status_code == 401


def test_cache_salt_isolates_requests_behind_one_key(engine):
    engine.prefix_cache.clear()
    with TestClient(create_app(ServerConfig(engine, model_id="tiny"))) as client:
        for _ in range(2):
            reused(client, chat(SECRET, cache_salt="user-1"))
        assert reused(client, chat(SECRET, cache_salt="user-2")) == 0
        assert reused(client, chat(SECRET)) == 0
        assert reused(client, chat(SECRET, cache_salt="user-1")) > 0
        refused = client.post("/v1/chat/completions", json=chat(SECRET, cache_salt=""))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def test_several_keys_from_the_command_line_and_a_file(engine, tmp_path, monkeypatch):
    from snapkv_rag.cli import build_parser
    from snapkv_rag.errors import SnapKVRagError
    from snapkv_rag.server.config import build_config

    monkeypatch.delenv("SNAPKV_RAG_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-carol\n\nkey-dave\n")
    args = build_parser().parse_args(["serve", "--api-key", "key-alice", "--api-key", "key-bob", "--api-keys-file", str(keys), "--embedder", "none"])
    assert build_config(args, engine=engine).api_keys == ("key-alice", "key-bob", "key-carol", "key-dave")
    monkeypatch.setenv("SNAPKV_RAG_API_KEY", "key-env1,key-env2")
    assert build_config(build_parser().parse_args(["serve", "--embedder", "none"]), engine=engine).api_keys == ("key-env1", "key-env2")
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(SnapKVRagError, match="holds no key"):
        build_config(build_parser().parse_args(["serve", "--api-keys-file", str(tmp_path / "empty"), "--embedder", "none"]), engine=engine)


def test_score_reuses_and_stores_prompt_kv_only_under_its_salt(engine):
    engine.prefix_cache.clear()
    engine.generate(SECRET, max_new_tokens=2)  # the shared namespace holds the secret
    before = engine.prefix_cache.stats().reused_tokens
    engine.score(SECRET, [5, 6, 7], cache_salt="attacker")
    assert engine.prefix_cache.stats().reused_tokens == before  # nothing read from the shared namespace
    engine.score(SECRET, [5, 6, 7], cache_salt="victim")
    assert engine.generate(SECRET, cache_salt="other", max_new_tokens=2).stats.reused_prompt_tokens == 0
    assert engine.generate(SECRET, cache_salt="victim", max_new_tokens=2).stats.reused_prompt_tokens > 0  # what score stored


# --------------------------------------------------------------------------- Ray replicas: routing and the replica header

LONG_SECRET = "The vault code is 4417. " + "Answer from the harbour timetable only. " * 120
LONG_WRONG = "The vault code is 9999. " + "Answer from the harbour timetable only. " * 120


def test_a_prompt_has_other_affinity_keys_in_another_namespace():
    from snapkv_rag.server.affinity import affinity_keys

    alice = affinity_keys(LONG_SECRET, [DOC], namespace="alice")
    bob = affinity_keys(LONG_SECRET, [DOC], namespace="bob")
    assert affinity_keys(LONG_SECRET, [DOC], namespace="alice") == alice  # stable: a tenant's follow-ups keep their replica
    assert not set(alice[0] + alice[1]) & set(bob[0] + bob[1])
    assert not set(alice[0] + alice[1]) & set(sum(affinity_keys(LONG_SECRET, [DOC]), []))  # nor the shared namespace's


def test_another_tenants_right_guess_routes_as_a_wrong_one():
    from snapkv_rag.server.affinity import AffinityTable, affinity_keys

    live = {"r1", "r2"}
    table = AffinityTable()
    table.record(sum(affinity_keys(LONG_SECRET, [DOC], namespace="victim"), []), "r1")
    assert table.best(*affinity_keys(LONG_SECRET + " Next?", [DOC], namespace="victim"), live)[0] == "r1"  # the victim's follow-up
    right = table.best(*affinity_keys(LONG_SECRET, [DOC], namespace="attacker"), live)
    wrong = table.best(*affinity_keys(LONG_WRONG, [DOC], namespace="attacker"), live)
    assert right == wrong == (None, 0.0)


def test_the_replica_header_is_a_tag_of_the_tenant_not_the_replica(engine):
    from snapkv_rag.server.app import InProcess

    class OnReplica(InProcess):  # the engine in process, its streams named as a Ray replica's are
        async def open(self, config, request):
            stream = await super().open(config, request)
            stream.replica = "replica-7f3a"
            return stream

    config = ServerConfig(engine, model_id="tiny", api_key=["key-alice", "key-bob"], backend=OnReplica(engine))
    with TestClient(create_app(config)) as client:

        def served_by(key: str, **extra) -> str:
            response = client.post("/v1/chat/completions", json=chat("Hi", **extra), headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            return response.headers["x-snapkv-replica"]

        alice = served_by("key-alice")
        assert served_by("key-alice") == alice  # stable within a tenant: its follow-ups show where they ran
        assert len({alice, served_by("key-bob"), served_by("key-alice", cache_salt="s"), "replica-7f3a"}) == 4


def test_kept_contexts_are_reused_only_by_their_own_tenant(engine):
    engine.kept_contexts.clear()

    def context_reuse(question: str, key: str) -> str:
        body = chat(f"{SECRET}\n\n{question}", keep_context=True)
        response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return response.json()["snapkv"]["context_reuse"]

    with TestClient(create_app(ServerConfig(engine, model_id="tiny", api_key=["key-alice", "key-bob"]))) as client:
        assert context_reuse("What is the code?", "key-alice") == "stored"
        assert context_reuse("Which vault?", "key-bob") == "stored"  # bob's same documents tell him nothing of alice's
        assert context_reuse("Which vault?", "key-alice") == "reused"
        refused = client.post("/v1/chat/completions", json=chat(SECRET, keep_context="yes"), headers={"Authorization": "Bearer key-alice"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "keep_context"
