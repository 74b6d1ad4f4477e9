"""``snapkv-rag serve --replicas 2``: two engine replicas on a local Ray instance, as users start it.

The routing table is tested without Ray; the server is a real subprocess (tiny model, one
thread per replica) driven over HTTP: answers, errors, affinity of follow-ups, a killed replica.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tokenizer, free_port, tiny_model

from snapkv_rag.server.affinity import BLOCK_CHARS, AffinityTable, affinity_keys

pytest.importorskip("ray.serve", reason="the 'ray' extra is not installed")


# --------------------------------------------------------------------------- the routing table


def conversation(opening: str, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Answer from the log."}, {"role": "user", "content": opening}]
    for t in range(turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"follow-up {t}"}]
    return messages


def test_a_follow_up_matches_the_replica_that_ran_its_opening():
    table = AffinityTable()
    a, b = conversation("alpha " * 2000, 0), conversation("beta " * 2000, 0)
    for messages, replica in ((a, "r1"), (b, "r2")):
        table.record(affinity_keys(messages)[0], replica)
    table.record(affinity_keys(conversation("alpha " * 2000, 1))[0], "r1")  # a follow-up starts nothing new
    assert table.started("r1") == table.started("r2") == 1
    owner, share = table.best(*affinity_keys(conversation("alpha " * 2000, 2)), {"r1", "r2"})
    assert owner == "r1" and 0.9 < share < 1.0  # all but the follow-up's own last block
    assert table.best(*affinity_keys(conversation("beta " * 2000, 1)), {"r1", "r2"})[0] == "r2"
    assert table.best(*affinity_keys(conversation("gamma " * 2000, 0)), {"r1", "r2"}) == (None, 0.0)
    # a replica that is gone is never chosen, and forgetting it drops its keys
    assert table.best(*affinity_keys(conversation("alpha " * 2000, 2)), {"r2"}) == (None, 0.0)
    before = len(table)
    table.forget("r1")
    assert 0 < len(table) < before


def test_the_longest_prefix_wins_then_the_most_chunks():
    table = AffinityTable()
    shared = "x" * (3 * BLOCK_CHARS)
    table.record(affinity_keys(shared)[0], "short")
    table.record(affinity_keys(shared + "y" * (2 * BLOCK_CHARS))[0], "long")
    assert table.best(*affinity_keys(shared + "y" * (2 * BLOCK_CHARS) + "question"), {"short", "long"})[0] == "long"
    assert table.best(*affinity_keys(shared + "z" * BLOCK_CHARS), {"short", "long"})[0] in {"short", "long"}  # the shared blocks, last writer
    docs = [f"document {i} " * 50 for i in range(4)]
    table.record(affinity_keys("", docs[:3])[1], "chunks-a")
    table.record(affinity_keys("", docs[3:])[1], "chunks-b")
    owner, share = table.best(*affinity_keys("no shared prefix", docs), {"chunks-a", "chunks-b"})
    assert owner == "chunks-a" and share == 0.75


def test_the_table_forgets_the_least_recently_used_keys():
    table = AffinityTable(max_keys=10)
    for i in range(30):
        table.record([bytes([i])], f"r{i % 2}")
    assert len(table) == 10
    assert table.best([bytes([29])], [], {"r1"})[0] == "r1" and table.best([bytes([0])], [], {"r0", "r1"}) == (None, 0.0)


# --------------------------------------------------------------------------- the router's policy


class FakeReplica:
    def __init__(self, name: str):
        self.replica_id = type("ReplicaID", (), {"unique_id": name, "__repr__": lambda self: name})()


class QueueLengths(dict):
    def get(self, replica_id, default=None):  # the router reads Ray's queue-length cache by replica id
        return super().get(replica_id.unique_id, default)


def router(mode: str = "affinity", imbalance: int = 2):
    from ray.serve.request_router import PendingRequest  # noqa: F401 (Ray must import for the router's module)

    from snapkv_rag.server.ray_serve import CacheAffinityRouter

    r = CacheAffinityRouter.__new__(CacheAffinityRouter)  # the policy alone: Ray's own state is not needed
    r.initialize_state(mode=mode, imbalance=imbalance)
    r._replica_queue_len_cache = QueueLengths()
    return r


def pending(messages: list[dict], namespace: str | None = None):
    from snapkv_rag.server.protocol import ParsedRequest

    sampling = {"cache_salt": namespace} if namespace is not None else {}  # as the ingress sets it
    request = ParsedRequest(kind="chat", model="m", prompt=messages, stream=False, include_usage=False, sampling=sampling)
    return type("Pending", (), {"args": [request], "metadata": None})()


def route(r, replicas, messages, namespace: str | None = None) -> str:
    import asyncio

    ranks = asyncio.run(r.choose_replicas(replicas, pending(messages, namespace)))
    chosen = ranks[0][0]
    r.on_request_routed(pending(messages, namespace), chosen.replica_id, None)
    return chosen.replica_id.unique_id


def test_the_router_keeps_conversations_on_their_replica_until_the_load_is_too_uneven():
    r, replicas = router(imbalance=2), [FakeReplica("a"), FakeReplica("b")]
    first = {name: route(r, replicas, conversation(name * 3000, 0)) for name in "xy"}
    assert sorted(first.values()) == ["a", "b"]  # new conversations spread
    assert route(r, replicas, conversation("x" * 3000, 1)) == first["x"]
    r._replica_queue_len_cache.update({first["x"]: 2, first["y"]: 0})  # 2 more in flight: still affinity
    assert route(r, replicas, conversation("x" * 3000, 2)) == first["x"]
    r._replica_queue_len_cache.update({first["x"]: 3})  # 3 more: the least loaded replica
    assert route(r, replicas, conversation("x" * 3000, 3)) == first["y"]
    assert route(r, [FakeReplica(first["y"])], conversation("x" * 3000, 1)) == first["y"]  # its replica is gone


def test_another_tenants_right_guess_is_routed_as_a_wrong_one():
    """Issue 73, defect 1: the router keyed on the prompt alone, so a tenant's guess of another
    tenant's prompt went to the replica that ran it, and a wrong guess elsewhere."""
    secret, wrong = conversation("vault code 4417 " * 200, 0), conversation("vault code 9999 " * 200, 0)

    def after_the_victim(guess) -> tuple[str, str]:
        r, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
        victim = route(r, replicas, secret, "victim-namespace")
        return victim, route(r, replicas, guess, "attacker-namespace")

    (victim, right), (_, wrong_choice) = after_the_victim(secret), after_the_victim(wrong)
    assert right == wrong_choice != victim  # both new to the attacker's namespace: the replica that started fewer
    r, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    first = route(r, replicas, secret, "victim-namespace")
    assert route(r, replicas, conversation("vault code 4417 " * 200, 1), "victim-namespace") == first  # affinity within a namespace


def test_round_robin_ignores_the_caches():
    r, replicas = router("round_robin"), [FakeReplica("a"), FakeReplica("b")]
    assert [route(r, replicas, conversation("x" * 3000, turn)) for turn in range(4)] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def test_bad_replica_options_fail_before_ray_starts(capsys):
    from snapkv_rag.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--threads", "0"]) == 2
    assert main(["serve", "--replicas", "2", "--routing-imbalance", "-1"]) == 2
    import ray

    assert not ray.is_initialized()


def test_an_unreachable_ray_address_is_one_error_line_not_a_hang():
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--replicas", "2", "--ray-address", "127.0.0.1:1", "--embedder", "none"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("snapkv-rag: error: cannot join the Ray cluster at 127.0.0.1:1")
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- the deployment


SERVER: dict = {}  # the ray_server fixture's process


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-ray")
    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer), context=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = free_port()
    log_path = folder / "serve.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--model", str(folder), "--replicas", "2", "--threads", "1"]
    command += ["--port", str(port), "--embedder", "none", "--served-model-name", "tinymodel", "--compression", "snapkv:budget=64", "--dtype", "float32"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    SERVER["process"] = process
    try:
        wait_for_replicas(base, 2, process, log_path, timeout=240)
        yield base
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_for_replicas(base: str, replicas: int, process, log_path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            health = httpx.get(base + "/health", timeout=5).json()
            if health.get("replicas") == replicas:
                return health
        except (httpx.HTTPError, json.JSONDecodeError):
            pass
        time.sleep(1)
    raise AssertionError(f"no {replicas} live replicas after {timeout} s:\n{log_path.read_text()[-4000:]}")


def chat(base: str, messages: list[dict], **fields) -> httpx.Response:
    body = {"model": "tinymodel", "messages": messages, "max_tokens": 6, **fields}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def test_two_replicas_serve_the_openai_api(ray_server):
    health = httpx.get(ray_server + "/health").json()
    assert health["status"] == "ok" and health["replicas"] == 2 and health["context_length"] == 4096
    model_id = httpx.get(ray_server + "/v1/models").json()["data"][0]["id"]
    first = chat(ray_server, [{"role": "user", "content": "hello"}], model=model_id)
    again = chat(ray_server, [{"role": "user", "content": "hello"}], model=model_id)
    assert first.status_code == 200, first.text
    assert first.headers["x-snapkv-replica"]
    salted = chat(ray_server, [{"role": "user", "content": "hello"}], model=model_id, cache_salt="tenant-s")
    assert salted.headers["x-snapkv-replica"] not in {first.headers["x-snapkv-replica"], again.headers["x-snapkv-replica"]}  # a tag of the namespace
    payload = first.json()
    assert payload["usage"]["completion_tokens"] == 6 and payload["snapkv"]["compression"]["method"] == "snapkv"
    assert again.json()["choices"][0]["message"]["content"] == payload["choices"][0]["message"]["content"]  # greedy, either replica
    with httpx.stream(
        "POST", ray_server + "/v1/chat/completions", json={"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    ) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) >= 1


def listening_addresses(session: int) -> list[str]:
    """Local addresses of the TCP sockets listening in processes of ``session`` (Ray's own among them)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session:
                    pids.add(int(entry))
            except OSError:
                pass
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line.split()[3] for line in lines if any(f"pid={pid}," in line for pid in pids)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_a_local_ray_instance_listens_on_loopback_only(ray_server):
    """Issue 51, item 9: Ray's GCS, raylet, agents and workers listened on every interface."""
    addresses = listening_addresses(SERVER["process"].pid)
    assert len(addresses) >= 5, addresses  # the Serve proxy, GCS, raylet, agents, workers
    exposed = [a for a in addresses if a.rpartition(":")[0] not in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")]
    assert exposed == [], (exposed, subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout)


def test_bad_requests_get_the_single_process_errors(ray_server):
    assert chat(ray_server, [], model="tinymodel").json()["error"]["param"] == "messages"
    unknown = chat(ray_server, [{"role": "user", "content": "hi"}], model="gpt-4")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = chat(ray_server, [{"role": "user", "content": "word " * 5000}])
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert chat(ray_server, [{"role": "user", "content": "hi"}], max_tokens=0).status_code == 400
    broken = httpx.post(ray_server + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]


def test_follow_ups_land_on_the_replica_holding_their_prefix(ray_server):
    openings = [f"Log of service {name}: " + " ".join(f"event {name}-{i} ok." for i in range(100)) for name in "abcd"]
    first_replica = {}
    for opening in openings:
        response = chat(ray_server, conversation(opening, 0))
        assert response.status_code == 200, response.text
        first_replica[opening] = response.headers["x-snapkv-replica"]
    assert len(set(first_replica.values())) == 2  # new conversations spread over both replicas
    for turn in (1, 2):
        for opening in openings:
            response = chat(ray_server, conversation(opening, turn))
            assert response.headers["x-snapkv-replica"] == first_replica[opening]
            stats = response.json()["snapkv"]
            assert stats["reused_prompt_tokens"] > 0.8 * response.json()["usage"]["prompt_tokens"]  # its opening came from that replica's prefix cache


def test_a_killed_replica_fails_its_request_cleanly_and_is_replaced(ray_server):
    body = {"model": "tinymodel", "messages": [{"role": "user", "content": "count"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", ray_server + "/v1/chat/completions", json=body, timeout=60) as response:
        replica = response.headers["x-snapkv-replica"]
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        kill_replica(replica)
        started = time.monotonic()
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert time.monotonic() - started < 30
    error = json.loads(events[-2])["error"] if events[-1] == "[DONE]" else json.loads(events[-1])["error"]
    assert error["code"] == "replica_unavailable"
    # the other replica answers meanwhile, and Ray brings the dead one back
    assert chat(ray_server, [{"role": "user", "content": "still there?"}]).status_code == 200
    deadline = time.monotonic() + 120
    while httpx.get(ray_server + "/health").json()["replicas"] != 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)


def kill_replica(replica_id: str) -> None:
    """Kill the actor of the Serve replica ``replica_id``, from a driver that joins the server's Ray instance."""
    code = (
        "import ray; ray.init(address='auto', logging_level='ERROR');"
        f"ray.kill(ray.get_actor('SERVE_REPLICA::snapkv-rag#EngineReplica#{replica_id}', namespace='serve'), no_restart=True)"
    )
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # the server's local Ray listens on loopback (a single-machine instance)
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)


def test_gpu_replica_options_are_checked_before_ray_starts(capsys):
    """Each replica sees the one GPU Ray gives it as cuda (cuda:1 failed inside every replica)."""
    from snapkv_rag.cli import main

    assert main(["serve", "--replicas", "2", "--device", "cuda:1"]) == 2
    assert "Ray gives each replica its own GPU" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--device", "cpu", "--gpus-per-replica", "0.5"]) == 2
    assert main(["serve", "--gpus-per-replica", "0.5", "--device", "cuda"]) == 2  # no replicas
    assert main(["serve", "--replicas", "2", "--device", "cuda", "--gpus-per-replica", "0"]) == 2
    import ray

    assert not ray.is_initialized()


def test_replicas_ask_ray_for_their_share_of_a_gpu():
    from snapkv_rag.cli import build_parser
    from snapkv_rag.server.ray_serve import replica_actor_options

    def options(*extra):
        return replica_actor_options(build_parser().parse_args(["serve", "--replicas", "2", "--threads", "3", *extra]))

    assert options("--device", "cuda", "--gpus-per-replica", "0.5")["num_gpus"] == 0.5
    assert options("--device", "cuda")["num_gpus"] == 1.0
    assert options("--device", "cpu") == {"num_cpus": 3, "num_gpus": 0, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "3"}}}


def test_replicas_take_their_share_of_a_gpu_without_device_cuda():
    """Replicas run on CUDA by default (no --device) where there is a GPU: --gpus-per-replica was refused
    there, and Ray was asked for a GPU only if the machine starting them had one."""
    from snapkv_rag.cli import build_parser
    from snapkv_rag.server.config import check_args
    from snapkv_rag.server.ray_serve import replica_actor_options

    args = build_parser().parse_args(["serve", "--replicas", "2", "--threads", "1", "--gpus-per-replica", "0.5"])
    check_args(args)
    assert replica_actor_options(args)["num_gpus"] == 0.5  # this machine has no GPU; the cluster's replicas do


@pytest.mark.parametrize("replicas_invariant", [True, False])
def test_models_reports_the_replicas_invariant_mode_not_the_ingress(monkeypatch, replicas_invariant):
    """The replicas' options and environment decide their mode; /v1/models reported the ingress's."""
    from starlette.testclient import TestClient

    from snapkv_rag.cli import build_parser
    from snapkv_rag.server import create_app
    from snapkv_rag.server.config import build_config
    from snapkv_rag.server.ray_serve import RayBackend

    monkeypatch.setenv("SNAPKV_RAG_INVARIANT", "0" if replicas_invariant else "1")  # the ingress's environment says otherwise
    description = {"context_length": 2048, "device": "cpu", "replica": "r1", "invariant": replicas_invariant}
    args = build_parser().parse_args(["serve", "--replicas", "2", "--embedder", "none", "--served-model-name", "m"])
    config = build_config(args, backend=RayBackend(None, description))
    with TestClient(create_app(config)) as client:
        card = client.get("/v1/models/m").json()
    assert card["snapkv"]["invariant"] is replicas_invariant
