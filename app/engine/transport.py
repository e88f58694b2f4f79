"""Length-prefixed msgpack frames between the engine process and its clients over a stream socket.

A frame is a 4-byte big-endian payload length and a msgspec msgpack payload: a ClientMessage from client to
engine, an EngineMessage from engine to client (tagged unions, so the decoder picks the struct).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import msgspec

HEADER = struct.Struct(">I")
_RECV_BYTES = 1 << 16


class Connection:
    """One end of a framed stream socket: sends from any thread, decoded messages read by one thread.

    `receives` is the type the peer sends: ClientMessage on the engine side, EngineMessage on the client side.
    """

    def __init__(self, sock: socket.socket, receives: Any) -> None:
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)
        self._send_lock = threading.Lock()
        self._buffer = bytearray()

    def send(self, *messages: msgspec.Struct) -> None:
        """Send messages in order as one write; raises OSError when the peer or the socket is gone."""
        data = bytearray()
        with self._send_lock:
            for message in messages:
                start = len(data)
                data += bytes(HEADER.size)
                self._encoder.encode_into(message, data, start + HEADER.size)
                HEADER.pack_into(data, start, len(data) - start - HEADER.size)
            self.sock.sendall(data)

    @property
    def buffered(self) -> bool:
        """Whether a whole message is already read from the socket (`receive` returns it without waiting)."""
        if len(self._buffer) < HEADER.size:
            return False
        return len(self._buffer) >= HEADER.size + HEADER.unpack_from(self._buffer)[0]

    def receive(self) -> Any:
        """The next message, or None once the connection has ended (peer closed, reset, or closed here)."""
        while True:
            if self.buffered:
                end = HEADER.size + HEADER.unpack_from(self._buffer)[0]
                message = self._decoder.decode(self._buffer[HEADER.size : end])
                del self._buffer[:end]
                return message
            try:
                chunk = self.sock.recv(_RECV_BYTES)
            except OSError:
                return None
            if not chunk:
                return None
            self._buffer += chunk

    def __iter__(self) -> Iterator[Any]:
        """Yield decoded messages until the connection ends."""
        while (message := self.receive()) is not None:
            yield message

    def close(self) -> None:
        """Shut the socket down (waking a blocked reader) and close it; safe to call more than once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
