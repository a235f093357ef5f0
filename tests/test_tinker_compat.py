"""The Tinker API compatibility layer: protobuf bodies read and written exactly as the SDKs
write and read them, and the shims installed in place of upstream's routes.

The byte strings below were produced by tinker 0.38.0 itself (`tinker.proto.request_conv.
forward_backward_request_to_proto`, and `tinker_public_pb2` messages serialized with
`deterministic=True`); 0.25.0 has the same wire format for these messages.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from txflow.upstream.skyrl_tx import protobuf, tinker_compat

# ForwardBackwardRequest(model_id="model_ab12", seq_id=3, loss_fn="ppo",
#   loss_fn_config={"clip_low_threshold": 0.8}, forward_only=True,
#   data=[Datum(model_input=ModelInput.from_ints([5, 17, 300]),
#               loss_fn_inputs={"target_tokens": [17, 300, 0], "weights": [0.0, 1.0, 0.5]})])
SDK_FORWARD_ONLY_REQUEST = bytes.fromhex(
    "0a0a6d6f64656c5f6162313210031a640a100a0e0a0c05000000110000002c01000012300a0d7461726765745f746f6b656e73121f"
    "0a1811000000000000002c0100000000000000000000000000001802220103121e0a077765696768747312130a0c000000000000803f"
    "0000003f1801220103220370706f2a1d0a12636c69705f6c6f775f7468726573686f6c64119a9999999999e93f30013a1f0a12636c"
    "69705f6c6f775f7468726573686f6c641209099a9999999999e93f"
)
# SampleResponse(sequences=[SampledSequence(stop_reason=LENGTH, tokens=int32 [42], logprobs=float32 [-1.5])])
SDK_SAMPLE_RESPONSE = bytes.fromhex("0a0e080112042a0000001a040000c0bf")
# ForwardBackwardOutput(loss_fn_output_type="scalar", one ArrayRecord of 2 datums with float32 fields
#   elementwise_loss [[0.5, 0.25], [1.0]] and logprobs [[-0.5, -0.25], [-1.0]])
SDK_FORWARD_BACKWARD_OUTPUT = bytes.fromhex(
    "0a067363616c6172127a123e0a10656c656d656e74776973655f6c6f7373122a0a0c0000003f0000803e0000803f1218000000000000"
    "000008000000000000000c00000000000000180112360a086c6f6770726f6273122a0a0c000000bf000080be000080bf121800000000"
    "0000000008000000000000000c0000000000000018011802"
)


def test_a_protobuf_forward_only_request_of_sdk_038_reads_as_upstreams_json_request():
    from tx.tinker import api

    request, forward_only = protobuf.parse_forward_backward(SDK_FORWARD_ONLY_REQUEST)

    assert forward_only is True
    assert request["model_id"] == "model_ab12"
    fb_input = request["forward_backward_input"]
    assert fb_input["loss_fn"] == "ppo" and fb_input["loss_fn_config"] == {"clip_low_threshold": 0.8}
    assert fb_input["data"] == [{"model_input": {"chunks": [{"tokens": [5, 17, 300]}]},
                                 "loss_fn_inputs": {"target_tokens": {"data": [17, 300, 0]},
                                                    "weights": {"data": [0.0, 1.0, 0.5]}}}]
    # Upstream's own request model takes it as it is.
    assert api.ForwardBackwardRequest.model_validate(request).forward_backward_input.data[0].model_input.chunks[0] \
        .tokens == [5, 17, 300]


def test_a_forward_backward_request_is_not_forward_only_unless_it_says_so():
    body = bytes.fromhex("0a036d2d31220d63726f73735f656e74726f7079")  # model_id "m-1", loss_fn "cross_entropy"
    request, forward_only = protobuf.parse_forward_backward(body)
    assert forward_only is False
    assert request["model_id"] == "m-1" and request["forward_backward_input"]["loss_fn"] == "cross_entropy"
    assert request["forward_backward_input"]["loss_fn_config"] is None


def _request_with_datum(datum: bytes) -> bytes:
    return protobuf._field(3, datum)  # ForwardBackwardRequest.data


def test_an_image_chunk_is_refused_by_name():
    image_chunk = protobuf._field(2, b"")  # Chunk.image
    with pytest.raises(ValueError, match="only text model inputs are supported"):
        protobuf.parse_forward_backward(_request_with_datum(protobuf._field(1, image_chunk)))


def test_a_sparse_loss_input_is_refused_by_name():
    tensor = protobuf._field(2, protobuf._field(1, b"\x00"))  # Tensor.sparse_csr
    entry = protobuf._field(1, "weights") + protobuf._field(2, tensor)
    with pytest.raises(ValueError, match="sparse tensors are not supported"):
        protobuf.parse_forward_backward(_request_with_datum(protobuf._field(2, entry)))


def test_a_text_valued_loss_config_is_refused_by_name():
    value = protobuf._field(2, "x")  # LossConfigValue.text
    entry = protobuf._field(1, "mode") + protobuf._field(2, value)
    with pytest.raises(ValueError, match="'mode' is text"):
        protobuf.parse_forward_backward(protobuf._field(7, entry))


def test_a_truncated_body_is_refused():
    with pytest.raises(ValueError, match="truncated"):
        protobuf.parse_forward_backward(SDK_FORWARD_ONLY_REQUEST[:-5])


def test_a_sample_result_is_written_as_the_sdk_writes_a_sample_response():
    result = {"sequences": [{"stop_reason": "length", "tokens": [42], "logprobs": [-1.5]}], "prompt_logprobs": None}
    assert protobuf.encode_sample_output(result) == SDK_SAMPLE_RESPONSE


def test_a_forward_backward_result_is_written_as_the_sdk_writes_its_output():
    # Upstream's result, as its JAX backend stores it (no metrics).
    result = {"loss_fn_output_type": "scalar", "metrics": {}, "loss_fn_outputs": [
        {"elementwise_loss": {"data": [0.5, 0.25], "dtype": "float32", "shape": [2]},
         "logprobs": {"data": [-0.5, -0.25], "dtype": "float32", "shape": [2]}},
        {"elementwise_loss": {"data": [1.0], "dtype": "float32", "shape": [1]},
         "logprobs": {"data": [-1.0], "dtype": "float32", "shape": [1]}},
    ]}
    assert protobuf.encode_forward_backward_output(result) == SDK_FORWARD_BACKWARD_OUTPUT


def _routes(app: FastAPI) -> dict[tuple[str, str], object]:
    return {(method, r.path): r.endpoint for r in app.router.routes if isinstance(r, APIRoute) for method in r.methods}


def test_install_replaces_the_upstream_routes_it_wraps_and_adds_the_missing_ones(monkeypatch):
    monkeypatch.delenv(tinker_compat.SKIP_ENV, raising=False)
    app = FastAPI()

    @app.post("/api/v1/asample")
    async def upstream_asample():
        return {}

    tinker_compat.install(app)
    routes = _routes(app)
    assert routes[("POST", "/api/v1/asample")] is tinker_compat.asample
    assert len([r for r in app.router.routes if getattr(r, "path", "") == "/api/v1/asample"]) == 1
    assert routes[("POST", "/api/v1/client/config")] is tinker_compat.client_config
    assert routes[("GET", "/api/v1/samplers/{sampler_id}")] is tinker_compat.get_sampler
    assert routes[("POST", "/api/v1/sessions/{session_id}/finish")] is tinker_compat.finish_session


def test_a_skipped_shim_leaves_the_upstream_route_alone(monkeypatch):
    monkeypatch.setenv(tinker_compat.SKIP_ENV, "4,1")
    app = FastAPI()

    @app.post("/api/v1/asample")
    async def upstream_asample():
        return {}

    tinker_compat.install(app)
    routes = _routes(app)
    assert routes[("POST", "/api/v1/asample")] is upstream_asample
    assert ("POST", "/api/v1/client/config") not in routes
    assert routes[("POST", "/api/v1/forward_backward")] is tinker_compat.forward_backward


def test_a_field_of_the_wrong_wire_type_is_refused_without_allocating_it():
    # Field 1 (model_id, text) sent as a varint of 2^40: read as bytes it would be bytes(2**40).
    with pytest.raises(ValueError, match="field 1 has the wrong wire type"):
        protobuf.parse_forward_backward(protobuf._int(1, 1 << 40))
    with pytest.raises(ValueError, match="wrong wire type"):
        protobuf.parse_forward_backward(protobuf._int(3, 7))  # data: a message, sent as a number
    with pytest.raises(ValueError, match="varint longer than 64 bits"):
        protobuf.parse_forward_backward(b"\x08" + b"\xff" * 11 + b"\x01")


def test_any_malformed_body_is_a_value_error_so_the_api_answers_400():
    import random

    valid = SDK_FORWARD_ONLY_REQUEST  # what tinker 0.38 sends
    protobuf.parse_forward_backward(valid)
    rng = random.Random(0)
    for _ in range(20_000):
        body = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        try:
            protobuf.parse_forward_backward(bytes(body))
        except ValueError:
            pass  # anything else would be a 500


def _sample(**fields) -> dict:
    params = {"max_tokens": 4, "seed": 0, "temperature": 0.0, **fields.pop("sampling_params", {})}
    return {"prompt": {"chunks": [{"tokens": [1, 2]}]}, "model_path": "tinker://m/sampler_weights/s",
            "sampling_params": params, **fields}


@pytest.mark.parametrize("stop, tokens, strings", [("\n", None, ["\n"]), (["\n", "."], None, ["\n", "."]),
                                                   ([7, 9], [7, 9], None), (None, None, None)])
def test_stop_is_read_as_the_sdks_types_allow_it(stop, tokens, strings):
    # tinker's SamplingParams.stop: str | Sequence[str] | Sequence[int] | None (0.13.1 and 0.38.0).
    params = tinker_compat.sample_request(_sample(sampling_params={"stop": stop})).sampling_params.to_types()
    assert (params.stop_tokens, params.stop_strings) == (tokens, strings)


@pytest.mark.parametrize("option, value", [("topk_prompt_logprobs", 5), ("topk_sample_logprobs", 2),
                                           ("target_prompt_logprobs", {"data": [1], "dtype": "int64"}),
                                           ("prompt_alt_tokens_k", 3), ("prompt_logprobs_last_n", 2),
                                           ("record_stability_info", True)])
def test_a_sampling_option_this_cluster_cannot_serve_is_refused_in_one_line(option, value):
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as refused:
        tinker_compat.sample_request(_sample(prompt_logprobs=True, **{option: value}))
    assert refused.value.status_code == 400 and "\n" not in refused.value.detail
    assert refused.value.detail.startswith(f"{option}: not served by this cluster")
    # Left at its default (what every SDK sends unless asked), it passes.
    default = {"target_prompt_logprobs": None, "prompt_logprobs_last_n": None, "record_stability_info": False}
    assert tinker_compat.sample_request(_sample(prompt_logprobs=True, **{option: default.get(option, 0)}))
