"""Moving a request's KV blocks from a prefill worker to a decode worker.

`KVTransfer` is the interface (TCP now; RDMA / NIXL would be other implementations);
`TCPKVTransfer` sends block by block over a plain TCP connection, worker to worker:

    prefill worker                                   decode worker (listening on its KV port)
    send(addr, tid, blocks) ── connect ──────────▶   accept
        header: MAGIC, transfer id, block count  ─▶
        per block: hash | checksum | size | payload ─▶ verify checksum, keep (hash, payload)
                                               ◀──   ack: blocks accepted
    returns the accepted count                       receive(tid) returns them to the decode handler

A block whose checksum fails ends the transfer's accepted run there: what a receiver
keeps is always a prefix of the block chain, so whatever is missing is simply
recomputed by the decode engine. Every wait has a timeout; a transfer nobody claims
is dropped after `ttl` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"DIKV1\n"
HASH_SIZE = 16
_BLOCK_HEADER = struct.Struct(f"!{HASH_SIZE}s16sQ")  # block hash, blake2b-128 of the payload, payload size
MAX_BLOCK_BYTES = 1 << 30


class KVTransferError(RuntimeError):
    pass


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def as_bytes(payload: Any) -> bytes:
    """A block payload (bytes, memoryview, numpy array or uint8 torch tensor) as bytes."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    numpy = getattr(payload, "numpy", None)
    if numpy is not None:
        return numpy().tobytes()
    return bytes(memoryview(payload))


class KVTransfer(ABC):
    """Ships (block hash, payload) runs between workers.

    Contract:
    - `start()` (receiver side) begins accepting transfers and returns the address senders use.
    - `send(address, transfer_id, blocks)` (sender side) delivers the blocks, in order, and returns how many
      the receiver accepted (verified); raises `KVTransferError` if the receiver cannot be reached or the
      transfer breaks off, `TimeoutError` past `timeout` seconds.
    - `receive(transfer_id, timeout)` (receiver side) returns the accepted blocks of a finished transfer,
      a prefix of what was sent, each payload as bytes; raises `TimeoutError` if none finished in time.
    - `close()` stops accepting and drops unclaimed transfers.
    """

    @abstractmethod
    async def start(self) -> str: ...

    @abstractmethod
    async def send(self, address: str, transfer_id: str, blocks: Sequence[tuple[bytes, Any]],
                   timeout: float = 60.0) -> int: ...

    @abstractmethod
    async def receive(self, transfer_id: str, timeout: float = 60.0) -> list[tuple[bytes, bytearray]]: ...

    @abstractmethod
    async def close(self) -> None: ...


class TCPKVTransfer(KVTransfer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 ttl: float = 120.0) -> None:
        self.host, self.port = host, port
        self.advertise_host = advertise_host or (host if host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        self.ttl = ttl
        self._server: asyncio.base_events.Server | None = None
        self._done: dict[str, tuple[float, list[tuple[bytes, bytes]]]] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self.blocks_received = 0
        self.bytes_received = 0
        self.checksum_failures = 0

    # ------------------------------------------------------------------ receiver

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{self.advertise_host}:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(self._read_transfer(reader, writer), timeout=self.ttl)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, KVTransferError) as e:
            logger.warning("KV transfer from %s failed: %r", writer.get_extra_info("peername"), e)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _read_transfer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            raise KVTransferError("not a KV transfer")
        (tid_len,) = struct.unpack("!H", await reader.readexactly(2))
        transfer_id = (await reader.readexactly(tid_len)).decode()
        (count,) = struct.unpack("!I", await reader.readexactly(4))
        blocks: list[tuple[bytes, bytes]] = []
        intact = True
        for _ in range(count):
            block_hash, digest, size = _BLOCK_HEADER.unpack(await reader.readexactly(_BLOCK_HEADER.size))
            if size > MAX_BLOCK_BYTES:
                raise KVTransferError(f"block of {size} bytes")
            payload = await reader.readexactly(size)
            if intact and checksum(payload) == digest:
                blocks.append((block_hash, bytearray(payload)))
                self.bytes_received += size
            elif intact:
                intact = False  # keep a prefix of the chain only
                self.checksum_failures += 1
                logger.warning("KV transfer %s: block %d failed its checksum; the rest is recomputed",
                               transfer_id, len(blocks))
        self.blocks_received += len(blocks)
        self._expire()
        self._done[transfer_id] = (time.monotonic(), blocks)
        waiter = self._waiters.get(transfer_id)
        if waiter is not None:
            waiter.set()
        writer.write(struct.pack("!I", len(blocks)))
        await writer.drain()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        for tid in [t for t, (at, _) in self._done.items() if at < cutoff]:
            del self._done[tid]

    async def receive(self, transfer_id: str, timeout: float = 60.0) -> list[tuple[bytes, bytearray]]:
        if transfer_id not in self._done:
            event = self._waiters.setdefault(transfer_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout)
            finally:
                self._waiters.pop(transfer_id, None)
        return self._done.pop(transfer_id)[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._done.clear()

    # ------------------------------------------------------------------ sender

    async def send(self, address: str, transfer_id: str, blocks: Sequence[tuple[bytes, Any]],
                   timeout: float = 60.0) -> int:
        return await asyncio.wait_for(self._send(address, transfer_id, blocks), timeout)

    async def _send(self, address: str, transfer_id: str, blocks: Sequence[tuple[bytes, Any]]) -> int:
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as e:
            raise KVTransferError(f"cannot reach the KV receiver at {address}: {e}") from e
        try:
            tid = transfer_id.encode()
            writer.write(MAGIC + struct.pack("!H", len(tid)) + tid + struct.pack("!I", len(blocks)))
            for block_hash, payload in blocks:
                data = as_bytes(payload)
                writer.write(_BLOCK_HEADER.pack(block_hash, checksum(data), len(data)))
                writer.write(data)
                await writer.drain()  # block by block: the socket buffer bounds what is in flight
            (accepted,) = struct.unpack("!I", await reader.readexactly(4))
            return accepted
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise KVTransferError(f"KV transfer to {address} broke off: {e!r}") from e
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
