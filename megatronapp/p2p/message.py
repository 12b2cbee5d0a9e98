"""The framed point-to-point message: a fixed header, then the payload in its own dtype.

    header: int64[HEADER_LEN] = (dtype code, ndim, number of ids,
                                 shape padded to MAX_DIMS dims with 0, ids padded to MAX_IDS with -1)
    payload: the tensor's elements, in its own dtype (a bf16 activation costs bf16 bytes)

The ids say what the message is, so a receiver checks that it got what it expected instead
of trusting the sender's order: MegaDPP (kind, receiver's chunk, microbatch), the static
runtime (kind, chunk, microbatch), MegaFBD (iteration, microbatch) or (iteration,).

Two wire layouts of the same frame:
* one message (`pack_message` / `unpack_message`): header bytes then payload bytes in one
  uint8 tensor, for a receiver that knows the shape and dtype to expect (it allocates
  `empty_message` and finds out from the header whether the sender agreed);
* header and payload as two messages (`encode_header` / `decode_header`), for a receiver that
  must read the header to size the payload, or reads headers on the host while payloads stay
  on the GPU (MegaDPP, dpp/transport.py).
Worked example: a (2, 3) bf16 tensor with ids (0, 1, 4) packs into 88 header bytes then 12
payload bytes; header = (1, 2, 3, 2, 3, 0, 0, 0, 1, 4, -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.float64)
MAX_DIMS, MAX_IDS = 4, 4
HEADER_LEN = 3 + MAX_DIMS + MAX_IDS
HEADER_BYTES = HEADER_LEN * 8  # a multiple of every payload dtype's size: the payload view stays aligned


@dataclass(frozen=True)
class MessageHeader:
    dtype: torch.dtype
    shape: torch.Size
    ids: tuple[int, ...]

    @property
    def payload_bytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def check_sendable(tensor: torch.Tensor, ids: Sequence[int] = ()) -> None:
    """ValueError (one line) unless a header can describe `tensor` with `ids`."""
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ValueError(
            f"cannot send a {tensor.dim()}-dim {tensor.dtype} tensor (at most {MAX_DIMS} dims, dtypes {DTYPES})"
        )
    if len(ids) > MAX_IDS or any(i < 0 for i in ids):
        raise ValueError(f"message ids must be at most {MAX_IDS} non-negative integers, got {tuple(ids)}")


def compute_header(shape: Sequence[int], dtype: torch.dtype, ids: Sequence[int] = ()) -> list[int]:
    """The header's values for a payload of `shape` and `dtype` (pure)."""
    shape, ids = list(shape), [int(i) for i in ids]
    return [
        DTYPES.index(dtype),
        len(shape),
        len(ids),
        *shape,
        *[0] * (MAX_DIMS - len(shape)),
        *ids,
        *[-1] * (MAX_IDS - len(ids)),
    ]


def encode_header(tensor: torch.Tensor, ids: Sequence[int] = ()) -> torch.Tensor:
    """The header announcing `tensor` (int64[HEADER_LEN] on the CPU)."""
    check_sendable(tensor, ids)
    return torch.tensor(compute_header(tensor.shape, tensor.dtype, ids), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> MessageHeader:
    """The header's dtype, shape and ids; ValueError on a malformed header."""
    values = [int(x) for x in header.tolist()]
    if len(values) != HEADER_LEN:
        raise ValueError(f"malformed message header of {len(values)} values (expected {HEADER_LEN})")
    code, ndim, nids = values[:3]
    shape, ids = values[3 : 3 + MAX_DIMS], values[3 + MAX_DIMS :]
    if not (
        0 <= code < len(DTYPES)
        and 0 <= ndim <= MAX_DIMS
        and 0 <= nids <= MAX_IDS
        and min(shape[:ndim], default=0) >= 0
        and min(ids[:nids], default=0) >= 0
    ):
        raise ValueError(f"malformed message header {values}")
    return MessageHeader(DTYPES[code], torch.Size(shape[:ndim]), tuple(ids[:nids]))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack_message(tensor: torch.Tensor, ids: Sequence[int] = (), device: torch.device | None = None) -> torch.Tensor:
    """Header and payload as one uint8 tensor on `device` (default: the tensor's), assembled
    where the tensor is, then copied once (a GPU tensor staged for gloo crosses once)."""
    header = encode_header(tensor, ids).to(tensor.device, non_blocking=True)
    message = torch.cat([_as_bytes(header), _as_bytes(tensor.detach())])
    return message if device is None else message.to(device)


def pack_flat_message(
    parts: Sequence[torch.Tensor], ids: Sequence[int] = (), device: torch.device | None = None
) -> torch.Tensor:
    """The parts (one dtype, one device) flattened into one 1-dim payload, packed as by
    pack_message without first concatenating them on their own (one copy, not two)."""
    first = parts[0]
    numel = sum(p.numel() for p in parts)
    check_sendable(first, ids)
    header = torch.tensor(compute_header((numel,), first.dtype, ids), dtype=torch.int64)
    message = torch.cat(
        [_as_bytes(header.to(first.device, non_blocking=True))] + [_as_bytes(p.detach()) for p in parts]
    )
    return message if device is None else message.to(device)


def message_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return HEADER_BYTES + torch.Size(shape).numel() * dtype.itemsize


def empty_message(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A receive buffer for one packed message with a payload of `shape` and `dtype`."""
    return torch.empty(message_nbytes(shape, dtype), dtype=torch.uint8, device=device)


def split_message(message: torch.Tensor, what: str, source: int) -> tuple[MessageHeader, torch.Tensor]:
    """(header, payload) of a packed message, the payload a view of `message` in the header's
    dtype and shape; RuntimeError if it does not fill the buffer. Reads the header on the
    host: on a GPU buffer that waits for the message to arrive."""
    header = decode_header(message[:HEADER_BYTES].view(torch.int64))
    if HEADER_BYTES + header.payload_bytes != message.numel():
        raise RuntimeError(
            f"{what} from rank {source}: a {tuple(header.shape)} {header.dtype} payload does not "
            f"fill the {message.numel() - HEADER_BYTES} bytes expected"
        )
    return header, message[HEADER_BYTES:].view(header.dtype).view(header.shape)


def unpack_message(message: torch.Tensor, expected_ids: Sequence[int], what: str, source: int) -> torch.Tensor:
    """The payload of a packed message after checking its ids (split_message); RuntimeError
    naming the sender and both sides otherwise."""
    header, payload = split_message(message, what, source)
    if header.ids != tuple(expected_ids):
        raise RuntimeError(f"{what} from rank {source}: expected ids {tuple(expected_ids)}, got {header.ids}")
    return payload


def unpack_expected(
    message: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, ids: Sequence[int], what: str, source: int
) -> torch.Tensor:
    """The payload of a packed message whose whole header the receiver knows in advance.
    On the CPU as unpack_message; on a GPU the header is compared on the device
    (torch._assert_async), so the host never waits for the message to arrive."""
    if not message.is_cuda:
        payload = unpack_message(message, ids, what, source)
        if (payload.shape, payload.dtype) != (torch.Size(shape), dtype):
            raise RuntimeError(
                f"{what} from rank {source}: expected {tuple(shape)} {dtype}, "
                f"got {tuple(payload.shape)} {payload.dtype}"
            )
        return payload
    expected = torch.tensor(compute_header(shape, dtype, ids), dtype=torch.int64).to(message.device, non_blocking=True)
    torch._assert_async((message[:HEADER_BYTES].view(torch.int64) == expected).all())
    return message[HEADER_BYTES:].view(dtype).view(shape)
