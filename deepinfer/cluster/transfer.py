"""Moving a request's KV blocks from a prefill worker to a decode worker, while the prefill still runs.

`KVTransfer` is the interface (TCP now; RDMA / NIXL would be other implementations). One transfer is
a stream: the sender opens it when the prefill starts, hands in blocks as chunks complete, and
finishes it after the first token; the receiver sees the blocks as they land:

    prefill worker                                     decode worker (listening on its KV port)
    open(addr, tid) ── connect, MAGIC | nonce_s ─────▶ accept
                    ◀── nonce_r | HMAC(token, receiver, nonce_s, nonce_r) ── (the sender checks it)
                    ── tid | HMAC(token, sender, nonce_r, nonce_s, tid) ─▶ check ─▶ on_transfer(IncomingTransfer)
    stream.send(blocks)   (returns at once; a background task writes them)
        per block: B | hash | checksum | size | payload ─▶ verify checksum ─▶ `async for batch in incoming`
    stream.finish() ── E | blocks sent ──────────────▶ the iteration ends
                    ◀── ack: blocks verified ───────
    connection lost before E ────────────────────────▶ the iteration raises KVTransferError

The handshake proves the cluster token both ways (`cluster/auth.py`) before any KV byte moves: a
receiver closes the connection on a wrong proof without reading further, and a sender sends no block
to a receiver that cannot prove the token. Fresh nonces on both sides: a recorded handshake replays
nothing. Without a token (none configured) the HMAC key is empty and every peer passes, as before.

A block whose checksum fails ends what the receiver keeps: it is always a prefix of the
block chain, so whatever is missing is simply recomputed by the decode engine. Every wait
has a timeout; a connection that stays open past `ttl` seconds is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"DIKV3\n"  # v3: the token handshake
NONCE_SIZE = 16
MAC_SIZE = 32  # HMAC-SHA256
HANDSHAKE_TIMEOUT = 10.0  # a peer that does not complete the handshake by then is dropped
HASH_SIZE = 16
_BLOCK_HEADER = struct.Struct(f"!{HASH_SIZE}s16sQ")  # block hash, blake2b-128 of the payload, payload size
_BLOCK, _END = b"B", b"E"
MAX_BLOCK_BYTES = 1 << 30

Block = tuple[bytes, Any]  # (chained block hash, payload: bytes-like or a uint8 tensor)


class KVTransferError(RuntimeError):
    pass


def handshake_mac(token: str | None, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `role` and the length-prefixed `parts`, keyed by the cluster token (b"" without
    one). `role` (b"receiver" / b"sender") keeps one side's proof from being replayed as the other's."""
    msg = b"deepinfer-kv-transfer|" + role + b"".join(struct.pack("!H", len(p)) + p for p in parts)
    return hmac.new((token or "").encode(), msg, hashlib.sha256).digest()


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


class KVSendStream(ABC):
    """The sender's side of one transfer. `blocks_sent`: blocks written so far."""

    blocks_sent: int = 0

    @abstractmethod
    def send(self, blocks: Sequence[Block]) -> None:
        """Queue blocks (the next ones of the chain); returns at once, never raises (a failure is
        reported by `finish`)."""

    @abstractmethod
    async def finish(self, timeout: float = 60.0) -> int:
        """Send what is queued, end the transfer and return how many blocks the receiver verified;
        KVTransferError if it broke off, TimeoutError past `timeout`."""

    @abstractmethod
    async def abort(self) -> None:
        """Break the transfer off (the receiver sees it fail)."""


class IncomingTransfer:
    """The receiver's side of one transfer: `async for batch in it` yields the verified blocks (payloads
    as bytearrays) as they arrive, several per batch when they arrive faster than they are consumed;
    the iteration ends when the sender finishes and raises KVTransferError if the transfer broke off.
    Transport implementations feed it with `put`, `end` and `fail`."""

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.started = time.monotonic()
        self.blocks_received = 0
        self._queue: asyncio.Queue[Block | BaseException | None] = asyncio.Queue()

    def put(self, block: Block) -> None:
        self.blocks_received += 1
        self._queue.put_nowait(block)

    def end(self) -> None:
        self._queue.put_nowait(None)

    def fail(self, error: BaseException) -> None:
        self._queue.put_nowait(error)

    async def __aiter__(self) -> AsyncIterator[list[Block]]:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch = [b for b in items if isinstance(b, tuple)]
            if batch:
                yield batch
            last = items[-1]
            if last is None:
                return
            if isinstance(last, BaseException):
                raise last


class KVTransfer(ABC):
    """Ships (block hash, payload) runs between workers.

    Contract:
    - `start(on_transfer)` (receiver side) begins accepting transfers and returns the address senders
      use; each transfer is handed to `on_transfer` as an `IncomingTransfer` when it begins. Without a
      handler, finished transfers are kept for `receive`.
    - `open(address, transfer_id)` (sender side) starts a transfer: a `KVSendStream`; KVTransferError
      if the receiver cannot be reached.
    - `send(address, transfer_id, blocks)`: a whole transfer at once (open, send, finish).
    - `receive(transfer_id, timeout)` (no handler): the verified blocks of a finished transfer;
      TimeoutError if none finished in time.
    - `close()` stops accepting and drops unclaimed transfers.
    """

    @abstractmethod
    async def start(self, on_transfer: Callable[[IncomingTransfer], Awaitable[None]] | None = None) -> str: ...

    @abstractmethod
    async def open(self, address: str, transfer_id: str, timeout: float = 10.0) -> KVSendStream: ...

    @abstractmethod
    async def receive(self, transfer_id: str, timeout: float = 60.0) -> list[tuple[bytes, bytearray]]: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def send(self, address: str, transfer_id: str, blocks: Sequence[Block], timeout: float = 60.0) -> int:
        stream = await self.open(address, transfer_id, timeout)
        stream.send(blocks)
        return await stream.finish(timeout)


class TCPKVTransfer(KVTransfer):
    """`token`: the cluster token both ends must hold (None: none configured, every peer passes)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 ttl: float = 120.0, token: str | None = None) -> None:
        self.host, self.port = host, port
        self._token = token
        self.refused = 0  # connections closed in the handshake (wrong protocol or no token)
        self.advertise_host = advertise_host or (host if host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        self.ttl = ttl
        self._server: asyncio.base_events.Server | None = None
        self._on_transfer: Callable[[IncomingTransfer], Awaitable[None]] | None = None
        self._handlers: set[asyncio.Task] = set()
        self._done: dict[str, tuple[float, list[tuple[bytes, bytearray]]]] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self.blocks_received = 0
        self.bytes_received = 0
        self.checksum_failures = 0

    # ------------------------------------------------------------------ receiver

    async def start(self, on_transfer: Callable[[IncomingTransfer], Awaitable[None]] | None = None) -> str:
        self._on_transfer = on_transfer or self._collect
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{self.advertise_host}:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        incoming: IncomingTransfer | None = None
        try:
            try:
                async with asyncio.timeout(min(HANDSHAKE_TIMEOUT, self.ttl)):
                    transfer_id = await self._accept_handshake(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, KVTransferError) as e:
                self.refused += 1
                logger.warning("KV transfer connection from %s refused: %r", writer.get_extra_info("peername"), e)
                return
            async with asyncio.timeout(self.ttl):
                incoming = IncomingTransfer(transfer_id)
                task = asyncio.get_running_loop().create_task((self._on_transfer or self._collect)(incoming))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)
                accepted = await self._read_blocks(reader, incoming)
                incoming.end()
                writer.write(struct.pack("!I", accepted))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, KVTransferError) as e:
            logger.warning("KV transfer from %s failed: %r", writer.get_extra_info("peername"), e)
            if incoming is not None:
                incoming.fail(KVTransferError(f"the KV transfer broke off: {e!r}"))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _accept_handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """The receiver's half of the handshake; returns the transfer id, or raises before any block is
        read (the caller closes the connection)."""
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            raise KVTransferError("not a KV transfer (or another protocol version)")
        theirs = await reader.readexactly(NONCE_SIZE)
        ours = secrets.token_bytes(NONCE_SIZE)
        writer.write(ours + handshake_mac(self._token, b"receiver", theirs, ours))
        await writer.drain()
        (tid_len,) = struct.unpack("!H", await reader.readexactly(2))
        tid = await reader.readexactly(tid_len)
        proof = await reader.readexactly(MAC_SIZE)
        if not hmac.compare_digest(proof, handshake_mac(self._token, b"sender", ours, theirs, tid)):
            raise KVTransferError("the peer did not prove the cluster token")
        try:
            return tid.decode("ascii")
        except UnicodeDecodeError as e:
            raise KVTransferError("the transfer id is not ASCII") from e

    async def _read_blocks(self, reader: asyncio.StreamReader, incoming: IncomingTransfer) -> int:
        """Read frames up to the end frame; hand on the verified prefix; return its length."""
        intact = True
        while True:
            kind = await reader.readexactly(1)
            if kind == _END:
                await reader.readexactly(4)  # blocks sent: what the receiver verified is what counts
                return incoming.blocks_received
            if kind != _BLOCK:
                raise KVTransferError(f"unknown frame {kind!r}")
            block_hash, digest, size = _BLOCK_HEADER.unpack(await reader.readexactly(_BLOCK_HEADER.size))
            if size > MAX_BLOCK_BYTES:
                raise KVTransferError(f"block of {size} bytes")
            payload = bytearray(await reader.readexactly(size))
            # hashlib drops the GIL on large buffers: verifying off the loop keeps the receiver responsive
            if intact and await asyncio.to_thread(checksum, payload) == digest:
                incoming.put((block_hash, payload))
                self.blocks_received += 1
                self.bytes_received += size
            elif intact:
                intact = False  # keep a prefix of the chain only
                self.checksum_failures += 1
                logger.warning("KV transfer %s: block %d failed its checksum; the rest is recomputed",
                               incoming.transfer_id, incoming.blocks_received)

    async def _collect(self, incoming: IncomingTransfer) -> None:
        """The handler without one given: keep a finished transfer's blocks for `receive`."""
        blocks: list[tuple[bytes, bytearray]] = []
        with contextlib.suppress(KVTransferError):
            async for batch in incoming:
                blocks.extend(batch)
        cutoff = time.monotonic() - self.ttl
        for tid in [t for t, (at, _) in self._done.items() if at < cutoff]:
            del self._done[tid]
        self._done[incoming.transfer_id] = (time.monotonic(), blocks)
        waiter = self._waiters.get(incoming.transfer_id)
        if waiter is not None:
            waiter.set()

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
        for task in list(self._handlers):
            task.cancel()
        self._done.clear()

    # ------------------------------------------------------------------ sender

    async def open(self, address: str, transfer_id: str, timeout: float = 10.0) -> KVSendStream:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
        except (OSError, ValueError, TimeoutError) as e:
            raise KVTransferError(f"cannot reach the KV receiver at {address}: {e!r}") from e
        try:
            ours = secrets.token_bytes(NONCE_SIZE)
            writer.write(MAGIC + ours)
            reply = await asyncio.wait_for(reader.readexactly(NONCE_SIZE + MAC_SIZE),
                                           max(0.0, deadline - time.monotonic()))
            theirs, proof = reply[:NONCE_SIZE], reply[NONCE_SIZE:]
            if not hmac.compare_digest(proof, handshake_mac(self._token, b"receiver", ours, theirs)):
                raise KVTransferError(f"the KV receiver at {address} did not prove the cluster token")
            tid = transfer_id.encode("ascii")
            writer.write(struct.pack("!H", len(tid)) + tid + handshake_mac(self._token, b"sender", theirs, ours, tid))
        except BaseException as e:
            writer.close()
            if isinstance(e, KVTransferError):
                raise
            if isinstance(e, OSError | TimeoutError | asyncio.IncompleteReadError | UnicodeEncodeError):
                raise KVTransferError(f"KV transfer handshake with {address} failed: {e!r}") from e
            raise
        return _TCPSendStream(address, reader, writer)


class _TCPSendStream(KVSendStream):
    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address, self._reader, self._writer = address, reader, writer
        self._queue: asyncio.Queue[list[Block] | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump())
        self.blocks_sent = 0

    def send(self, blocks: Sequence[Block]) -> None:
        if blocks and not self._task.done():
            self._queue.put_nowait(list(blocks))

    async def _pump(self) -> int:
        writer = self._writer
        try:
            while (blocks := await self._queue.get()) is not None:
                data = [as_bytes(p) for _, p in blocks]
                digests = await asyncio.to_thread(lambda d=data: [checksum(x) for x in d])
                for (block_hash, _), payload, digest in zip(blocks, data, digests, strict=True):
                    writer.write(_BLOCK + _BLOCK_HEADER.pack(block_hash, digest, len(payload)))
                    writer.write(payload)
                    await writer.drain()  # block by block: the socket buffer bounds what is in flight
                    self.blocks_sent += 1
            writer.write(_END + struct.pack("!I", self.blocks_sent))
            await writer.drain()
            (accepted,) = struct.unpack("!I", await self._reader.readexactly(4))
            return accepted
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise KVTransferError(f"KV transfer to {self.address} broke off: {e!r}") from e
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def finish(self, timeout: float = 60.0) -> int:
        self._queue.put_nowait(None)
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            await self.abort()
            raise

    async def abort(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, KVTransferError):
            await self._task
