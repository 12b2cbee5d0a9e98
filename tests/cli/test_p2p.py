"""The framed point-to-point message (p2p/message.py) and the Outbox of sends (p2p/outbox.py).

Pure round trips over dtypes, shapes and ids; the Outbox against a stand-in isend that records
what was issued and which works were waited for; one real gloo exchange of a packed bf16 message.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatronapp.p2p import outbox as outbox_module
from megatronapp.p2p.message import (
    HEADER_BYTES,
    HEADER_LEN,
    MessageHeader,
    compute_header,
    decode_header,
    empty_message,
    encode_header,
    message_nbytes,
    pack_flat_message,
    pack_message,
    split_message,
    unpack_expected,
    unpack_message,
)
from megatronapp.p2p.outbox import Outbox, Send, sends_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
SHAPES = ((), (7,), (2, 3), (2, 3, 4), (1, 2, 3, 5))


def _sample(shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_packed_message_round_trips_dtype_shape_values_and_ids(dtype, shape):
    x = _sample(shape, dtype)
    message = pack_message(x, ids=(3, 1, 4))
    assert message.dtype == torch.uint8 and message.numel() == message_nbytes(shape, dtype)
    got = unpack_message(message.clone(), (3, 1, 4), "activation", source=2)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, x)  # bit-exact: no detour through another dtype
    assert torch.equal(unpack_expected(message, shape, dtype, (3, 1, 4), "activation", 2), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_two_message_layout_round_trips_the_same_header(dtype):
    x = _sample((2, 3), dtype)
    header = encode_header(x, ids=(1, 0, 5))
    assert header.dtype == torch.int64 and header.numel() == HEADER_LEN
    assert decode_header(header) == MessageHeader(dtype, torch.Size((2, 3)), (1, 0, 5))
    assert header.tolist() == compute_header((2, 3), dtype, (1, 0, 5))


def test_the_worked_example_of_the_module_docstring():
    assert compute_header((2, 3), torch.bfloat16, (0, 1, 4)) == [1, 2, 3, 2, 3, 0, 0, 0, 1, 4, -1]
    assert message_nbytes((2, 3), torch.bfloat16) == 88 + 12 == HEADER_BYTES + 12


def test_a_bf16_activation_costs_bf16_bytes():
    x = torch.randn(4, 16, 32).bfloat16()
    assert pack_message(x, ids=(0, 1)).numel() == HEADER_BYTES + x.numel() * 2
    assert pack_message(x.float(), ids=(0, 1)).numel() == HEADER_BYTES + x.numel() * 4


def test_parts_pack_as_one_flat_payload():
    parts = [torch.randn(2, 3).bfloat16().reshape(-1), torch.randn(5).bfloat16()]
    header, payload = split_message(pack_flat_message(parts, ids=(70_001,)), "weights", 0)
    assert header == MessageHeader(torch.bfloat16, torch.Size((11,)), (70_001,))
    assert torch.equal(payload, torch.cat(parts))


def test_ids_are_optional_and_their_count_is_kept():
    x = torch.arange(3.0)
    assert decode_header(encode_header(x)).ids == ()
    assert decode_header(encode_header(x, (9,))).ids == (9,)
    assert torch.equal(unpack_message(pack_message(x, (9,)), (9,), "losses", 1), x)


def test_a_message_with_other_ids_is_an_error_naming_the_sender_and_both_sides():
    message = pack_message(torch.zeros(2, 3), ids=(4, 1))
    with pytest.raises(RuntimeError, match=r"stage input from rank 5: expected ids \(4, 2\), got \(4, 1\)"):
        unpack_message(message, (4, 2), "stage input", 5)


def test_a_message_of_another_size_or_dtype_is_an_error():
    message = pack_message(torch.zeros(2, 3), ids=(0,))
    buffer = empty_message((3, 3), torch.float32, "cpu")
    buffer[: message.numel()] = message
    with pytest.raises(RuntimeError, match=r"a \(2, 3\) torch.float32 payload does not fill the 36 bytes"):
        unpack_message(buffer, (0,), "output grad", 1)
    half = pack_message(torch.zeros(4, 3, dtype=torch.float16), ids=(0,))  # the same bytes as (2, 3) fp32
    with pytest.raises(RuntimeError, match=r"expected \(2, 3\) torch.float32, got \(4, 3\) torch.float16"):
        unpack_expected(half, (2, 3), torch.float32, (0,), "activation", 1)


@pytest.mark.parametrize(
    "tensor, ids, message",
    [
        (torch.zeros(1, 1, 1, 1, 1), (), "cannot send a 5-dim"),
        (torch.zeros(2, dtype=torch.bool), (), "cannot send a 1-dim torch.bool"),
        (torch.zeros(2), (1, 2, 3, 4, 5), "at most 4 non-negative"),
        (torch.zeros(2), (-1,), "at most 4 non-negative"),
    ],
)
def test_what_a_header_cannot_describe_is_refused_at_once(tensor, ids, message):
    with pytest.raises(ValueError, match=message):
        encode_header(tensor, ids)


@pytest.mark.parametrize(
    "values",
    [
        [9] + [0] * (HEADER_LEN - 1),
        [0, 5] + [0] * (HEADER_LEN - 2),
        [0, 1, 0, -2] + [0] * (HEADER_LEN - 4),
        [0] * (HEADER_LEN - 1),
    ],
)
def test_a_malformed_header_is_refused(values):
    with pytest.raises(ValueError, match="malformed message header"):
        decode_header(torch.tensor(values, dtype=torch.int64))


class _Work:
    def __init__(self, log: list, name):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name))


def _recording_isend(monkeypatch, log: list):
    def isend(tensor, dst, tag=0, group=None):
        log.append(("isend", dst, tag, threading.current_thread().name))
        return _Work(log, (dst, tag))

    monkeypatch.setattr(outbox_module.dist, "isend", isend)


def test_a_window_waits_for_the_oldest_entry_beyond_it(monkeypatch):
    log: list = []
    _recording_isend(monkeypatch, log)
    waited = []
    outbox = Outbox(window=2)
    for m in range(3):
        outbox.post(sends_to(torch.zeros(2), (m, m + 10)), waiting=lambda: _Noted(waited))
    # the third post waited for both sends of the first entry, and only then issued its own
    assert [e[:2] for e in log] == [
        ("isend", 0),
        ("isend", 10),
        ("isend", 1),
        ("isend", 11),
        ("wait", (0, 0)),
        ("wait", (10, 0)),
        ("isend", 2),
        ("isend", 12),
    ]
    assert waited == ["entered"]
    outbox.drain()
    assert log[-4:] == [("wait", (1, 0)), ("wait", (11, 0)), ("wait", (2, 0)), ("wait", (12, 0))]


class _Noted:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("entered")

    def __exit__(self, *exc):
        return False


def test_a_threaded_outbox_issues_in_post_order_off_the_posting_thread(monkeypatch):
    log: list = []
    _recording_isend(monkeypatch, log)
    outbox = Outbox(threaded=True)
    for m in range(3):
        outbox.post([Send(torch.zeros(1, dtype=torch.int64), m, 7), Send(torch.zeros(2), m, 8)])
    outbox.drain()
    issued = [e for e in log if e[0] == "isend"]
    assert [(d, t) for _, d, t, _ in issued] == [(m, tag) for m in range(3) for tag in (7, 8)]
    assert {name for *_, name in issued} == {"p2p-send"}
    with pytest.raises(RuntimeError, match="closed"):
        outbox.post(sends_to(torch.zeros(1), (0,)))


def test_a_failed_send_is_raised_by_the_next_post_or_drain(monkeypatch):
    def broken_isend(tensor, dst, tag=0, group=None):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(outbox_module.dist, "isend", broken_isend)
    outbox = Outbox(threaded=True)
    outbox.post(sends_to(torch.zeros(2), (1,)))
    with pytest.raises(RuntimeError, match="sending failed: connection reset by peer"):
        outbox.drain()
    with pytest.raises(ValueError, match="window must be >= 1 and inline"):
        Outbox(window=2, threaded=True)


def _exchange_packed(rank: int, world: int) -> list | None:
    import torch.distributed as dist

    x = (torch.arange(12.0).view(3, 4) / 7).bfloat16()
    if rank == 0:
        outbox = Outbox(window=1)
        outbox.post(sends_to(pack_message(x, ids=(2, 5)), (1,)))
        outbox.drain()
        return None
    buffer = empty_message(x.shape, x.dtype, "cpu")
    dist.irecv(buffer, 0).wait()
    got = unpack_expected(buffer, x.shape, x.dtype, (2, 5), "activation", 0)
    return [got.dtype == torch.bfloat16, torch.equal(got, x), buffer.numel()]


def test_a_packed_bf16_message_crosses_gloo_intact(cluster):
    assert cluster.run(_exchange_packed, 2)[1] == [True, True, HEADER_BYTES + 12 * 2]


def test_fbd_sends_one_packed_copy_per_link_device_in_the_activations_dtype():
    """MegaFBD's sends (fbd/links.py): a bf16 stage input costs bf16 bytes, packed once per link
    device and sent to every peer on that device."""
    from megatronapp.fbd.links import LinkDevices

    cpu, meta = torch.device("cpu"), torch.device("meta")
    links = LinkDevices({4: cpu, 5: meta, 6: cpu}, cpu)
    x = torch.randn(2, 8, 16).bfloat16()
    sends = links.packed_sends(x, (3, 1), (4, 5, 6))
    assert [s.dst for s in sends] == [4, 6, 5]
    assert sends[0].tensor is sends[1].tensor and sends[2].tensor.device == meta
    assert sends[0].tensor.numel() == HEADER_BYTES + x.numel() * 2
    assert torch.equal(unpack_message(sends[0].tensor, (3, 1), "stage input", 0), x)


@pytest.mark.gpu
def test_a_packed_message_unpacks_on_the_gpu_and_stages_through_the_host():
    """On a GPU the header is compared on the device (no host wait); a message staged for gloo
    is packed where the tensor is and crosses to the host once."""
    x = torch.randn(4, 8, device="cuda").bfloat16()
    message = pack_message(x, (0, 1, 2))
    got = unpack_expected(message, x.shape, x.dtype, (0, 1, 2), "activation", 0)
    torch.cuda.synchronize()  # a mismatched header would fail the device-side assert here
    assert got.device.type == "cuda" and torch.equal(got, x)
    staged = pack_message(x, (0, 1, 2), torch.device("cpu"))
    assert staged.device.type == "cpu" and torch.equal(unpack_message(staged, (0, 1, 2), "activation", 0), x.cpu())
