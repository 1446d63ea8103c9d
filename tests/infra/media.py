"""Media built byte by byte from each format's specification, for the stub provider's tests.

Only the headers a provider reads for sizes and durations are real; the rest is zeros. Shared
by the OpenAI and Anthropic stub suites (and any test that sends a stub an image, audio or a
PDF), so that one builder is checked against one specification.
"""

from __future__ import annotations

import base64
import struct


def png(width: int, height: int) -> bytes:
    # Signature, then IHDR: length 13, type, width, height, depth, colour, 3 method bytes, CRC.
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR"
            + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0) + bytes(4))


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9)
    return b"\xff\xd8" + app0 + sof0 + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + bytes(3)


def webp(width: int, height: int, kind: str) -> bytes:
    if kind == "VP8X":
        payload = bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    elif kind == "VP8L":
        payload = b"\x2f" + ((width - 1) | (height - 1) << 14).to_bytes(4, "little")
    else:
        payload = bytes(3) + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    chunk = kind.encode() + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def wav(seconds_x100: int, rate: int = 16_000) -> bytes:
    """Mono 16-bit PCM: `rate` * 2 bytes a second."""
    data_bytes = rate * 2 * seconds_x100 // 100
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt "
            + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_bytes)
            + bytes(data_bytes))


def mp3(frames: int) -> bytes:
    """MPEG-1 layer III, 128 kbps, 44.1 kHz, no padding: 144 * 128000 // 44100 = 417 bytes and
    1,152 samples a frame; behind a 20-byte ID3v2 tag."""
    frame = b"\xff\xfb\x90\x00" + bytes(417 - 4)
    return b"ID3\x04\x00\x00" + bytes([0, 0, 0, 10]) + bytes(10) + frame * frames


def pdf(pages: int) -> bytes:
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages))
    body = [b"%PDF-1.4", b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj",
            f"2 0 obj << /Type /Pages /Kids [{kids}] /Count {pages} >> endobj".encode()]
    body += [f"{3 + i} 0 obj << /Type /Page /Parent 2 0 R >> endobj".encode()
             for i in range(pages)]
    return b"\n".join([*body, b"%%EOF"])


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
