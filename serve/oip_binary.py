"""The Open Inference Protocol's binary tensor data extension: request bodies in, response bodies out.

A request body is JSON, or, with the ``Inference-Header-Content-Length: N`` header, N bytes of JSON followed by
the raw bytes of the inputs that carry ``"parameters": {"binary_data_size": B}`` (in the order of ``inputs``,
each B bytes, little-endian, row-major, no ``data`` field). Sent as ``application/json``,
``application/octet-stream`` or without a Content-Type (tritonclient's clients), never compressed.

* :func:`read_infer_body`: the body under the server's size cap (413) and deadline (408);
* :func:`split_body`: (the parsed JSON header, the binary tail); a header length that is not a number or runs
  past the body is a 400;
* :func:`binary_inputs`: {input name: its bytes}, each ``binary_data_size`` checked against what is left, and
  the tail consumed exactly (a body shorter or longer than its header says is a 400);
* :func:`array_from_bytes`: one input's bytes as an array of its datatype and shape, its size checked against
  datatype × shape, NaN / infinity refused as in JSON (400 naming the tensor);
* :func:`binary_output` / :func:`bytes_output`: an output's JSON entry and raw bytes (a BYTES output, the
  classification extension's, as the protocol serializes it: each element a 4-byte little-endian length, then
  its bytes);
* :func:`encode_response`: the response body and headers, binary outputs after the JSON header with
  ``Inference-Header-Content-Length`` and ``application/octet-stream``.
"""

from __future__ import annotations

import json
import math

import numpy as np

from prunus.artifacts.finite_arrays import describe, first_nonfinite

from .http_guard import BadRequest, parse_json_body

HEADER_LENGTH = "Inference-Header-Content-Length"
MEDIA_TYPES = {"", "application/json", "application/octet-stream"}
DEFAULT_MAX_BODY_BYTES = 64 << 20  # 64 rows of a 3 × 224 × 224 FP32 image batch (38.5 MB) fit in binary


def check_media(headers) -> None:
    """415 for a Content-Type the protocol does not send, or a compressed body."""
    media = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media not in MEDIA_TYPES:
        raise BadRequest(415, f"infer bodies are application/json or application/octet-stream (binary tensor data), "
                              f"not {media[:80]!r}", code="unsupported_media_type")
    encoding = (headers.get("content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise BadRequest(415, f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed",
                         code="unsupported_media_type")


async def read_infer_body(receive, headers, timeout: float, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413), within ``timeout`` seconds (408)."""
    from .asgi_guard import read_body

    return await read_body(receive, headers, timeout, limit, f"the request body is larger than the server's limit of "
                           f"{limit} bytes; send fewer rows per request, or start the server with a larger --max-body-mb")


def split_body(body: bytes, header_length: str | None) -> tuple[object, bytes]:
    """(the parsed JSON header, the bytes after it); the whole body is JSON without ``header_length``."""
    if header_length is None:
        return parse_json_body(body), b""
    text = header_length.strip()
    if not text.isdigit():
        raise BadRequest(400, f"{HEADER_LENGTH} {header_length[:40]!r} is not a byte count")
    n = int(text)
    if n > len(body):
        raise BadRequest(400, f"{HEADER_LENGTH} {n} runs past the body's end ({len(body)} bytes); send the JSON "
                              "header's length in bytes")
    return parse_json_body(body[:n]), body[n:]


def binary_size(entry: dict, where: str) -> int | None:
    """An input's ``binary_data_size`` (None: its data is JSON); any other parameter is a 400."""
    params = entry.get("parameters")
    if params is None:
        return None
    if not isinstance(params, dict) or set(params) - {"binary_data_size"}:
        raise BadRequest(400, f"{where}: the only parameter an input takes is binary_data_size")
    if "binary_data_size" not in params:
        return None
    size = params.get("binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest(400, f"{where}: binary_data_size must be a byte count (an integer >= 0)")
    return size


def binary_inputs(inputs: list, tail: bytes) -> dict[str, bytes]:
    """{input name: its bytes} for the inputs that carry binary data, in order; the tail consumed exactly."""
    out, offset = {}, 0
    for entry in inputs:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue  # the tensor reader names this one
        where = f"input tensor {entry['name'][:80]!r}"
        size = binary_size(entry, where)
        if size is None:
            continue
        if offset + size > len(tail):
            raise BadRequest(400, f"{where}: binary_data_size {size} runs past the body's end ({len(tail) - offset} "
                                  f"bytes of binary data left after the JSON header); send all of its bytes")
        out[entry["name"]] = tail[offset:offset + size]
        offset += size
    if offset != len(tail):
        raise BadRequest(400, f"the body holds {len(tail)} bytes after the JSON header where the inputs' "
                              f"binary_data_size add up to {offset}; send exactly the bytes they declare")
    return out


def array_from_bytes(raw: bytes, dtype: np.dtype, datatype: str, shape: list[int], where: str) -> np.ndarray:
    """``raw`` as a little-endian array of ``shape``; 400 when its size is not datatype × shape or it holds a value
    JSON would refuse (NaN, infinity; a BOOL byte other than 0 or 1)."""
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise BadRequest(400, f"{where}: binary_data_size {len(raw)} where {datatype} × shape {shape} needs "
                              f"{need} bytes")
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    if datatype == "BOOL":
        bad = np.flatnonzero(np.frombuffer(raw, np.uint8) > 1)
        if bad.size:
            raise BadRequest(400, f"{where}: byte {int(bad[0])} is {raw[bad[0]]}, not a BOOL value (0 or 1)")
    i = first_nonfinite(array)
    if i is not None:
        raise BadRequest(400, f"{where}: element {i} is {describe(array.reshape(-1)[i])}, not a finite {datatype} "
                              "value")
    return array


def binary_output(out: np.ndarray, name: str, datatype: str) -> tuple[dict, bytes]:
    """(an output's JSON entry, its little-endian bytes)."""
    raw = np.ascontiguousarray(out, dtype=out.dtype.newbyteorder("<")).tobytes()
    return ({"name": name, "datatype": datatype, "shape": list(out.shape),
             "parameters": {"binary_data_size": len(raw)}}, raw)


def bytes_output(out: np.ndarray, name: str) -> tuple[dict, bytes]:
    """(a BYTES output's JSON entry, its elements row-major, each a 4-byte little-endian length and its bytes)."""
    raw = b"".join(len(b).to_bytes(4, "little") + b for b in out.reshape(-1))
    return ({"name": name, "datatype": "BYTES", "shape": list(out.shape),
             "parameters": {"binary_data_size": len(raw)}}, raw)


def encode_response(header: dict, tails: list[bytes]) -> tuple[bytes, dict]:
    """(the response body, its headers): JSON alone, or the JSON header then ``tails`` when any output is binary."""
    text = json.dumps(header).encode()
    if not tails:
        return text, {"Content-Type": "application/json"}
    return b"".join([text, *tails]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}
