"""The protobuf wire format of the Tinker SDKs (0.25, 0.38), for only the messages `tinker_compat`'s shims
read and write: a ForwardBackwardRequest in, a ForwardBackwardOutput and a SampleResponse out. Field
numbers are those of `tinker_public.proto` (tinker/proto/tinker_public_pb2.py); hand-written because the
SDK 0.13.1 txflow runs with ships no protobuf module."""

from __future__ import annotations

import struct

import numpy as np

# Field numbers are those of `tinker_public.proto` (tinker/proto/tinker_public_pb2.py, 0.25 and 0.38).

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_DTYPES = {1: "<f4", 2: "<i8"}  # DType enum: FLOAT32, INT64
_DTYPE_ENUM = {"float32": 1, "int64": 2}
_STOP_REASONS = {"stop": 0, "length": 1}


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        if shift >= 64:  # a varint is at most 10 bytes: anything longer is not protobuf (and unbounded)
            raise ValueError("varint longer than 64 bits")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _parse(buf: bytes) -> dict[int, list]:
    """A message's fields: number -> values (int for varints, bytes otherwise), in wire order."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        wire = key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            value, pos = buf[pos:pos + size], pos + size
        elif wire == _BYTES:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated field")
        fields.setdefault(key >> 3, []).append(value)
    return fields


def _one(fields: dict, number: int, default=None):
    """A singular field (proto3: its last value wins), of the wire kind its default says: bytes or an int. A
    sender's other kind is an error, never a value used as the other (bytes(n) would allocate n bytes)."""
    values = fields.get(number)
    if not values:
        return default
    value = values[-1]
    if default is not None and isinstance(value, int) != isinstance(default, int):
        raise ValueError(f"field {number} has the wrong wire type")
    return value


def _messages(fields: dict, number: int) -> list[dict[int, list]]:
    """A repeated message field, each parsed."""
    values = fields.get(number, [])
    if any(isinstance(v, int) for v in values):
        raise ValueError(f"field {number} has the wrong wire type")
    return [_parse(v) for v in values]


def _read_double(fields: dict, number: int) -> float:
    value = _one(fields, number, bytes(8))
    if len(value) != 8:
        raise ValueError(f"field {number} is not a double")
    return struct.unpack("<d", value)[0]


def _text(fields: dict, number: int) -> str:
    return _one(fields, number, b"").decode()


def _tensor(buf: bytes) -> dict:
    tensor = _parse(buf)
    if 2 in tensor:
        raise ValueError("sparse tensors are not supported")
    dtype = _DTYPES.get(_one(tensor, 3, 0))
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {_one(tensor, 3, 0)}")
    return {"data": np.frombuffer(_one(tensor, 1, b""), dtype=dtype).tolist()}


def _raw(fields: dict, number: int) -> list[bytes]:
    """A repeated message field, unparsed."""
    values = fields.get(number, [])
    if any(isinstance(v, int) for v in values):
        raise ValueError(f"field {number} has the wrong wire type")
    return values


def _datum(buf: bytes) -> dict:
    datum = _parse(buf)
    chunks = []
    for chunk in _messages(datum, 1):
        if 1 not in chunk:
            raise ValueError("only text model inputs are supported (no image or audio chunks)")
        chunks.append({"tokens": np.frombuffer(_one(_parse(_one(chunk, 1, b"")), 1, b""), dtype="<i4").tolist()})
    inputs = {}
    for entry in _messages(datum, 2):
        inputs[_text(entry, 1)] = _tensor(_one(entry, 2, b""))
    return {"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs}


def parse_forward_backward(body: bytes) -> tuple[dict, bool]:
    """A protobuf ForwardBackwardRequest as upstream's JSON request, and its `forward_only` flag."""
    msg = _parse(body)
    config: dict[str, float] = {}
    for entry in _messages(msg, 5):
        config[_text(entry, 1)] = _read_double(entry, 2)
    for entry in _messages(msg, 7):  # v2 config: numbers, or text that this server has no use for
        value = _parse(_one(entry, 2, b""))
        if 2 in value:
            raise ValueError(f"loss_fn_config {_text(entry, 1)!r} is text; this server takes numbers only")
        config[_text(entry, 1)] = _read_double(value, 1)
    request = {
        "model_id": _text(msg, 1),
        "forward_backward_input": {"data": [_datum(d) for d in _raw(msg, 3)], "loss_fn": _text(msg, 4),
                                   "loss_fn_config": config or None},
    }
    return request, bool(_one(msg, 6, 0))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | str) -> bytes:
    payload = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | _BYTES) + _varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3 | _VARINT) + _varint(value) if value else b""


def _double(number: int, value: float) -> bytes:
    return _varint(number << 3 | _FIXED64) + struct.pack("<d", value)


def encode_forward_backward_output(result: dict) -> bytes:
    """Upstream's ForwardBackwardOutput as a protobuf ForwardBackwardOutput: per field, one batched
    tensor holding every datum's values and their byte offsets."""
    outputs = result.get("loss_fn_outputs") or []
    out = _field(1, result.get("loss_fn_output_type", ""))
    if outputs:
        record = b""
        for name in dict.fromkeys(name for output in outputs for name in output):
            tensors = [output.get(name) or {"data": [], "dtype": "float32", "shape": [0]} for output in outputs]
            dtype = tensors[0].get("dtype", "float32")
            arrays = [np.asarray(t["data"], dtype=_DTYPES[_DTYPE_ENUM[dtype]]).ravel() for t in tensors]
            offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype("<i8")
            trailing = b"".join(_varint(d) for d in (tensors[0].get("shape") or [0])[1:])
            batched = (_field(1, b"".join(a.tobytes() for a in arrays)) + _field(2, offsets.tobytes())
                       + _int(3, _DTYPE_ENUM[dtype]) + (_field(4, trailing) if trailing else b""))
            record += _field(2, _field(1, name) + _field(2, batched))
        out += _field(2, record + _int(3, len(outputs)))
    for key, value in (result.get("metrics") or {}).items():
        out += _field(3, _field(1, key) + _double(2, float("nan") if value is None else float(value)))
    return out


def encode_sample_output(result: dict) -> bytes:
    """Upstream's SampleOutput as a protobuf SampleResponse (int32 tokens, float32 logprobs)."""
    out = b""
    for seq in result.get("sequences", []):
        out += _field(1, _int(1, _STOP_REASONS[seq["stop_reason"]])
                      + _field(2, np.asarray(seq["tokens"], dtype="<i4").tobytes())
                      + _field(3, np.asarray(seq.get("logprobs") or [], dtype="<f4").tobytes()))
    if result.get("prompt_logprobs") is not None:
        logprobs = [float("nan") if lp is None else lp for lp in result["prompt_logprobs"]]
        out += _field(2, np.asarray(logprobs, dtype="<f4").tobytes())
    return out
