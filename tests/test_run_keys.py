"""Keys of runs attached to a shared cluster (the `api-key-check` change): each opens only its own run's
sessions, models, sampling sessions, futures and checkpoints. On a bare FastAPI app with upstream's route
shapes and a real SQLite database in the tables' shape (the e2e test, test_shared_cluster_e2e, does it on
a real cluster)."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from itertools import count

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from txflow.upstream.skyrl_tx import auth

CLUSTER_KEY, KEY_A, KEY_B, KEY_A2 = "tml-cluster", "tml-run-a", "tml-run-b", "tml-run-a-again"


@pytest.fixture()
def served(tmp_path):
    yield from serving(tmp_path, None)


def serving(tmp_path, limits: auth.Limits | None):
    keys = tmp_path / "run-keys.json"
    # KEY_A2: a second attach under run A's id (another process given the same --run-id).
    keys.write_text(json.dumps({auth.key_digest(KEY_A): "run-a", auth.key_digest(KEY_B): "run-b",
                                auth.key_digest(KEY_A2): "run-a"}))
    ids = count(1)

    @asynccontextmanager
    async def lifespan(app):
        app.state.db_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tinker.db'}")
        async with app.state.db_engine.begin() as conn:
            await conn.execute(text("CREATE TABLE models (model_id TEXT PRIMARY KEY, session_id TEXT)"))
            await conn.execute(text("CREATE TABLE sampling_sessions (sampling_session_id TEXT PRIMARY KEY, "
                                    "session_id TEXT)"))
        yield
        await app.state.db_engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/api/v1/create_session")
    async def create_session():
        return {"session_id": f"session_{next(ids)}"}

    @app.post("/api/v1/create_model")
    async def create_model(body: dict, req: Request):
        model_id = f"model_{next(ids)}"
        async with req.app.state.db_engine.begin() as conn:
            await conn.execute(text("INSERT INTO models VALUES (:m, :s)"), {"m": model_id, "s": body["session_id"]})
        return {"model_id": model_id, "request_id": str(next(ids))}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(body: dict):
        return {"request_id": str(next(ids))}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: dict):
        return {"loss": 1.0}

    @app.post("/api/v1/load_weights")
    async def load_weights(body: dict):
        return {"request_id": str(next(ids))}

    @app.post("/api/v1/asample")
    async def asample(body: dict):
        return {"request_id": str(next(ids))}

    app.add_api_route("/api/v1/training_runs/{model_id}/checkpoints", lambda model_id: [])
    app.add_api_route("/api/v1/training_runs", lambda: ["every run"])
    app.add_api_route("/api/v1/healthz", lambda: "ok")
    auth.install(app, CLUSTER_KEY, auth.DownloadSigner(), str(keys), limits)
    with TestClient(app) as client:
        yield client, keys


def as_run(client, key):
    def post(path, body=None):
        return client.post(path, json=body or {}, headers={"X-API-Key": key})
    return post


def model_of(client, key) -> tuple[str, str]:
    post = as_run(client, key)
    session = post("/api/v1/create_session").json()["session_id"]
    return session, post("/api/v1/create_model", {"session_id": session}).json()["model_id"]


def test_a_runs_key_serves_its_own_model_and_gets_403_on_another_runs(served):
    client, _ = served
    a, b = as_run(client, KEY_A), as_run(client, KEY_B)
    session_a, model_a = model_of(client, KEY_A)
    session_b, model_b = model_of(client, KEY_B)
    future = a("/api/v1/forward_backward", {"model_id": model_a})
    assert future.status_code == 200
    assert a("/api/v1/retrieve_future", {"request_id": future.json()["request_id"]}).status_code == 200
    # Run B on run A's work: its model, its session, its future, its checkpoints, its state as a load source.
    assert b("/api/v1/forward_backward", {"model_id": model_a}).status_code == 403
    assert b("/api/v1/create_model", {"session_id": session_a}).status_code == 403
    assert b("/api/v1/retrieve_future", {"request_id": future.json()["request_id"]}).status_code == 403
    refused = client.get(f"/api/v1/training_runs/{model_a}/checkpoints", headers={"X-API-Key": KEY_B})
    assert refused.status_code == 403 and model_a in refused.json()["detail"]
    assert client.get(f"/api/v1/training_runs/{model_b}/checkpoints", headers={"X-API-Key": KEY_B}).status_code == 200
    assert b("/api/v1/load_weights", {"model_id": model_b,
                                      "path": f"tinker://{model_a}/weights/step-000004"}).status_code == 403
    assert b("/api/v1/load_weights", {"model_id": model_b,
                                      "path": f"tinker://{model_b}/weights/step-000004"}).status_code == 200
    # Listings span runs; an id nobody created is nobody's.
    assert client.get("/api/v1/training_runs", headers={"X-API-Key": KEY_A}).status_code == 403
    assert a("/api/v1/forward_backward", {"model_id": "model_nobody"}).status_code == 403


def test_the_clusters_own_key_is_unscoped_and_a_revoked_key_is_refused(served):
    client, keys = served
    _, model_a = model_of(client, KEY_A)
    admin = as_run(client, CLUSTER_KEY)
    assert admin("/api/v1/forward_backward", {"model_id": model_a}).status_code == 200
    assert client.get("/api/v1/training_runs", headers={"X-API-Key": CLUSTER_KEY}).status_code == 200
    assert as_run(client, "tml-unknown")("/api/v1/create_session").status_code == 401
    keys.write_text(json.dumps({auth.key_digest(KEY_B): "run-b"}))  # run A released
    assert as_run(client, KEY_A)("/api/v1/forward_backward", {"model_id": model_a}).status_code == 401
    assert client.get("/api/v1/healthz").status_code == 200


def test_the_run_keys_file_holds_digests_not_keys(served):
    _, keys = served
    assert KEY_A not in keys.read_text() and auth.key_digest(KEY_A) in keys.read_text()


def key_check(client) -> auth.KeyCheck:
    """The KeyCheck in front of the test app."""
    layer = client.app.middleware_stack
    while not isinstance(layer, auth.KeyCheck):
        layer = layer.app
    return layer


def test_a_body_the_check_cannot_read_as_its_route_does_is_refused(served):
    """The outside review's first bypass: the check read a JSON body sent as `application/json;
    profile=protobuf` as protobuf, failed, and let it through as naming nothing, while the route read the JSON
    (a neighbour's forward_backward got through). The check reads a body as its route does, or refuses it."""
    client, _ = served
    _, model_a = model_of(client, KEY_A)
    body = json.dumps({"model_id": model_a}).encode()

    def post_as_b(content_types: list[str], path: str = "/api/v1/forward_backward", data: bytes = body):
        headers = [("X-API-Key", KEY_B), *(("Content-Type", t) for t in content_types)]
        return client.post(path, content=data, headers=headers)

    for json_type in ("application/json; profile=protobuf", "Application/JSON", "application/vnd.x+json"):
        assert post_as_b([json_type]).status_code == 403, json_type  # read as JSON, as the route does: A's
    refused = {"two headers": post_as_b(["application/json", "application/x-protobuf"]),
               "protobuf that is JSON": post_as_b(["Application/X-Protobuf"]),
               "protobuf elsewhere": post_as_b(["application/x-protobuf"], "/api/v1/load_weights"),
               "another type": post_as_b(["text/plain"], "/api/v1/load_weights"),
               "unreadable JSON": post_as_b(["application/json"], data=b"{not json")}
    assert {what: r.status_code for what, r in refused.items()} == dict.fromkeys(refused, 400)
    assert refused["two headers"].json()["detail"] == "send one Content-Type header"
    assert as_run(client, KEY_A)("/api/v1/forward_backward", {"model_id": model_a}).status_code == 200


@pytest.mark.parametrize("spelling", ["TINKER://{}/weights/x", "Tinker://{}/weights/x", " tinker://{}/weights/x",
                                      "\ttinker://{}/weights/x", "tin\nker://{}/weights/x"])
def test_a_checkpoint_path_is_owned_by_the_model_the_route_reads_in_it_whatever_its_spelling(served, spelling):
    """The second bypass: the check matched the literal `tinker://`, the routes parse with urllib (any scheme
    case, leading blanks, tabs and newlines dropped), so a neighbour's sampler was loaded by a path spelled
    `TINKER://...`. The check now reads the path with the routes' own parser."""
    client, _ = served
    _, model_a = model_of(client, KEY_A)
    _, model_b = model_of(client, KEY_B)
    b = as_run(client, KEY_B)
    assert b("/api/v1/load_weights", {"model_id": model_b, "path": spelling.format(model_a)}).status_code == 403
    assert b("/api/v1/load_weights", {"model_id": model_b, "path": spelling.format(model_b)}).status_code == 200


def test_a_second_attach_under_the_same_run_id_owns_nothing_of_the_first_and_a_released_keys_work_is_forgotten(
        served):
    """The third bypass: ownership was keyed by run id, so a second run given the same --run-id owned the
    first's models, and ownership was never forgotten. It is keyed by the key (one attach); when a key leaves
    the run-keys file, what it created is forgotten."""
    client, keys = served
    session_a, model_a = model_of(client, KEY_A)
    again = as_run(client, KEY_A2)
    assert again("/api/v1/forward_backward", {"model_id": model_a}).status_code == 403
    assert again("/api/v1/create_model", {"session_id": session_a}).status_code == 403
    assert session_a in key_check(client).owners.sessions
    keys.write_text(json.dumps({auth.key_digest(KEY_B): "run-b", auth.key_digest(KEY_A2): "run-a"}))  # A released
    assert as_run(client, KEY_B)("/api/v1/create_session").status_code == 200
    assert session_a not in key_check(client).owners.sessions


def test_each_bound_is_refused_in_one_line_naming_its_limit_and_its_flag(tmp_path):
    """The review's last finding: nothing bounded a request (3e6 samples built 188 MiB of ids in the API's
    event loop). Each bound, per request for every key and per key for a run's, is refused with a 4xx whose
    one line names the limit and the flag that sets it; what is within the bounds passes."""
    limits = auth.Limits(body_mb=0.01, samples=8, tokens=64, batch=3, sessions=2, models=1)
    for client, _ in serving(tmp_path, limits):
        _, model_a = model_of(client, KEY_A)
        for key in (KEY_A, CLUSTER_KEY):
            post = as_run(client, key)
            sample = {"prompt": {"chunks": []}, "model_path": f"tinker://{model_a}/x"}
            answers = {
                "num_samples": post("/api/v1/asample", {**sample, "num_samples": 3_000_000,
                                                        "sampling_params": {"max_tokens": 4}}),
                "max_tokens": post("/api/v1/asample", {**sample, "num_samples": 1,
                                                       "sampling_params": {"max_tokens": 65}}),
                "batch": post("/api/v1/forward_backward", {"model_id": model_a, "forward_backward_input": {
                    "data": [{}] * 4, "loss_fn": "cross_entropy"}}),
                "body": client.post("/api/v1/forward_backward", content=b"x" * 20_000,
                                    headers={"X-API-Key": key, "Content-Type": "application/json"})}
            expected = {"num_samples": (400, "num_samples 3000000 is above this cluster's limit 8 (--api-max-samples)"),
                        "max_tokens": (400, "max_tokens 65 is above this cluster's limit 64 (--api-max-tokens)"),
                        "batch": (400, "a forward_backward of 4 items is above this cluster's limit 3 "
                                       "(--api-max-batch)"),
                        "body": (413, "the request body is above this cluster's limit of 0.01 MB "
                                      "(--api-max-body-mb)")}
            assert {k: (r.status_code, r.json()["detail"]) for k, r in answers.items()} == expected, key
            assert post("/api/v1/asample", {**sample, "num_samples": 8,
                                            "sampling_params": {"max_tokens": 64}}).status_code == 200
        # Per key, for a run's key: it holds one session and one model; a second session passes, a third not.
        a = as_run(client, KEY_A)
        session = a("/api/v1/create_session").json()["session_id"]
        third = a("/api/v1/create_session")
        assert third.status_code == 429 and third.json()["detail"] == (
            "sessions created with this key: 3 is above this cluster's limit 2 (--api-max-sessions-per-key)")
        second_model = a("/api/v1/create_model", {"session_id": session})
        assert second_model.status_code == 429 and "(--api-max-models-per-key)" in second_model.json()["detail"]
        assert as_run(client, CLUSTER_KEY)("/api/v1/create_session").status_code == 200  # the cluster's own key


def test_a_runs_key_is_told_what_it_holds_and_nothing_of_anothers(served):
    """`/api/v1/txflow/owned`: what a run's teardown unloads and a custom run commits on a shared cluster."""
    client, _ = served
    session_a, model_a = model_of(client, KEY_A)
    session_b, model_b = model_of(client, KEY_B)
    owned = client.get(auth.OWNED_PATH, headers={"X-API-Key": KEY_A})
    assert owned.status_code == 200 and owned.json() == {"sessions": [session_a], "models": [model_a]}
    assert client.get(auth.OWNED_PATH, headers={"X-API-Key": KEY_B}).json() == {"sessions": [session_b],
                                                                                "models": [model_b]}
    assert client.get(auth.OWNED_PATH, headers={"X-API-Key": KEY_A2}).json() == {"sessions": [], "models": []}
    assert client.get(auth.OWNED_PATH, headers={"X-API-Key": CLUSTER_KEY}).status_code == 400  # owns everything
    assert client.get(auth.OWNED_PATH).status_code == 401
    # The cluster's own key asks for a run key's holdings by its digest (the holder releasing a run that died);
    # a run's key asking for another's gets its own.
    of_b = {"owner": auth.key_digest(KEY_B)}
    assert client.get(auth.OWNED_PATH, params=of_b, headers={"X-API-Key": CLUSTER_KEY}).json() == {
        "sessions": [session_b], "models": [model_b]}
    assert client.get(auth.OWNED_PATH, params=of_b, headers={"X-API-Key": KEY_A}).json() == {
        "sessions": [session_a], "models": [model_a]}


def test_a_key_given_out_opens_until_it_expires(tmp_path):
    keys, clock = tmp_path / "run-keys.json", [1000.0]
    keys.write_text(json.dumps({auth.key_digest("tml-nb"): {"owner": "nb", "kind": "key", "expires": 1060.0},
                                auth.key_digest("tml-run"): {"owner": "run-a", "kind": "run"},
                                auth.key_digest("tml-old"): "run-b"}))  # a file of an earlier txflow: no expiry
    run_keys = auth.RunKeys(keys, clock=lambda: clock[0])
    assert run_keys.owner(b"tml-nb") == auth.key_digest("tml-nb")
    clock[0] = 1059.9
    assert run_keys.owner(b"tml-nb") is not None
    clock[0] = 1060.0
    assert run_keys.owner(b"tml-nb") is None  # expired: refused as if revoked
    assert run_keys.current() == {auth.key_digest("tml-run"), auth.key_digest("tml-old")}
    assert run_keys.owner(b"tml-unknown") is None
