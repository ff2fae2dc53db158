"""Reading a job's log: output.log holds the bytes, output.idx says which
stream (1 stdout, 2 stderr) each chunk came from.  Written by the relay in
ckptd-init; read here for `ckptd launch` pass-through and `ckptctl logs`."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

RECORD = struct.Struct("<QII")  # offset in output.log, length, stream


@dataclass
class Chunk:
    stream: int
    data: bytes
    offset: int


class LogFollower:
    def __init__(self, log: Path, index: Path, offset: int = 0) -> None:
        self.log = log
        self.index = index
        self.offset = offset  # next log byte to deliver
        self._index_pos = 0  # next index byte to read

    def _read_index(self) -> bytes:
        try:
            size = os.path.getsize(self.index)
        except OSError:
            return b""
        if size < self._index_pos:
            # the log was cut back by a restart: continue from the new end
            self._index_pos = size - size % RECORD.size
            self.offset = min(self.offset, os.path.getsize(self.log) if self.log.exists() else 0)
            return b""
        with open(self.index, "rb") as f:
            f.seek(self._index_pos)
            data = f.read(size - self._index_pos)
        data = data[: len(data) - len(data) % RECORD.size]
        self._index_pos += len(data)
        return data

    def poll(self) -> list[Chunk]:
        records = self._read_index()
        chunks: list[Chunk] = []
        if not records:
            return chunks
        with open(self.log, "rb") as f:
            for off, length, stream in RECORD.iter_unpack(records):
                end = off + length
                if end <= self.offset:
                    continue
                start = max(off, self.offset)
                f.seek(start)
                data = f.read(end - start)
                if data:
                    chunks.append(Chunk(stream, data, start))
                    self.offset = start + len(data)
        return chunks

    def follow(self, running: Callable[[], bool], interval: float = 0.05) -> Iterator[Chunk]:
        """Yield chunks until running() is false and nothing is left."""
        while True:
            alive = running()
            chunks = self.poll()
            yield from chunks
            if not alive and not chunks:
                return
            if not chunks:
                time.sleep(interval)
