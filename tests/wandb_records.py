"""Reads a wandb offline run file (`run-*.wandb`), so tests can check what the real SDK wrote.

The file is W&B's LevelDB-style log: a 7-byte header (`:W&B`, magic, version), then 32 KiB
blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last),
each record a `wandb_internal_pb2.Record` protobuf. The SDK no longer ships a Python reader.
"""

from __future__ import annotations

import struct
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a wandb run file"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            chunks.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            chunks.append(pending + chunk)
    records = []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def history(path: Path) -> list[dict]:
    """Each `run.log` call as {key: value}, in order."""
    import json

    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict:
    import json

    out: dict = {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
