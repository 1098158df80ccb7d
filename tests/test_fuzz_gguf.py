"""Seeded fuzzing of GGUF conversion: a valid tiny GGUF, mutated at random (byte flips, mostly in the header;
length, count, dimension and offset fields overwritten with huge or small values; type fields with any id;
truncation; a slice of the header repeated), each converted with ``from_gguf``. Every case either converts
or raises PrunusError with one line naming the file, writing nothing; no other exception, no hang."""

import random
import shutil
import signal
import struct
import time
import traceback

import pytest

from gguf_craft import layout, write_tiny
from prunus.artifacts.errors import PrunusError
from prunus.models.gguf_read import from_gguf

SEED = 1234
CASES = 200
CASE_SECONDS = 5  # one case past this is a hang
TOTAL_SECONDS = 30  # on a loaded 2-core machine; typically a few seconds
HUGE = (2**64 - 1, 2**63, 2**32, 2**32 - 1, 20_000_000, (1 << 21) + 1, 10**12)


def _fields(data: bytes) -> tuple[list[int], list[int]]:
    """Positions of the valid file's uint64 fields (counts, lengths, dimensions, offsets) and uint32 ones
    (value types, dimension counts, tensor types)."""
    where = layout(data)
    u64 = where["counts"] + where["lengths"]
    u32 = [kv[1] for kv in where["kv"].values()]
    for t in where["tensors"].values():
        u64 += [t["dims"], t["offset"]]
        u32 += [t["n_dims"], t["type"]]
    return u64, u32


def mutate(data: bytes, header_end: int, u64: list[int], u32: list[int], rng: random.Random) -> tuple[bytes, list]:
    log = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("flip", "flip", "flip", "huge", "small", "type", "truncate", "splice"))
        if kind == "flip":
            pos = rng.randrange(min(header_end, len(data)) if rng.random() < 0.8 else len(data))
            data = data[:pos] + bytes([data[pos] ^ rng.randrange(1, 256)]) + data[pos + 1:]
            log.append((kind, pos))
        elif kind in ("huge", "small"):
            pos = rng.choice(u64)
            value = rng.choice(HUGE + (rng.getrandbits(64),)) if kind == "huge" else rng.randrange(0, 300)
            data = data[:pos] + struct.pack("<Q", value) + data[pos + 8:]
            log.append((kind, pos, value))
        elif kind == "type":
            pos, value = rng.choice(u32), rng.randrange(0, 42)
            data = data[:pos] + struct.pack("<I", value) + data[pos + 4:]
            log.append((kind, pos, value))
        elif kind == "truncate":
            cut = rng.randrange(len(data))
            data = data[:cut]
            log.append((kind, cut))
        else:
            a = rng.randrange(header_end)
            b = min(header_end, a + rng.randrange(1, 64))
            data = data[:b] + data[a:b] + data[b:]
            log.append((kind, a, b))
    return data, log


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def test_mutated_gguf_files_convert_or_fail_in_one_line(tmp_path):
    valid = write_tiny(tmp_path / "valid.gguf").read_bytes()
    from_gguf(tmp_path / "valid.gguf", tmp_path / "valid-out")  # imports and first-call costs, outside the clock
    u64, u32 = _fields(valid)
    header_end = layout(valid)["end"]
    rng = random.Random(SEED)
    path, out = tmp_path / "case.gguf", tmp_path / "out"
    failures, outcomes = [], {"converted": 0, "refused": 0}
    previous = signal.signal(signal.SIGALRM, _alarm)
    start = time.perf_counter()
    try:
        for case in range(CASES):
            data, log = mutate(valid, header_end, u64, u32, rng)
            path.write_bytes(data)
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                from_gguf(path, out)
                outcomes["converted"] += 1
            except PrunusError as e:
                outcomes["refused"] += 1
                message = str(e)
                if "\n" in message or str(path) not in message or out.exists():
                    failures.append((case, log, f"not one line naming the file, or {out} written: {message!r}"))
            except _Hang:
                failures.append((case, log, f"ran past {CASE_SECONDS} s"))
            except Exception:  # the finding: anything but a PrunusError is a bug in the reader
                failures.append((case, log, traceback.format_exc(limit=3)))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    assert not failures, "\n\n".join(f"case {c} {log}:\n{why}" for c, log, why in failures[:5])
    assert outcomes["refused"] > CASES // 2 and outcomes["converted"] > 0, outcomes  # the mutations reach both ends
    assert elapsed < TOTAL_SECONDS, (elapsed, outcomes)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_mutations_are_seeded(seed):
    valid = bytes(range(256)) * 4
    runs = [mutate(valid, 512, [8, 16], [4], random.Random(seed)) for _ in range(2)]
    assert runs[0] == runs[1]
