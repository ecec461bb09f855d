#!/usr/bin/env node
// Closed-loop load generator for the shard-router benchmark (bench/): gRPC, or HTTP/JSON against the
// router's HTTP front.
//
// Not Python on purpose: a Python client on a 2-core machine fights the servers for the GIL and CPU
// and ends up measuring itself. N workers each keep one call in flight (closed loop): over a few
// HTTP/2 channels for gRPC; over a keep-alive HTTP/1.1 connection each for HTTP (Node's `http` module,
// one Agent, at most N sockets: HTTP/1.1 has one request in flight per connection).
// With --rate the workers start calls on a shared schedule instead (CPU per call compared at one
// rate: a server's fixed costs, PostgreSQL's commit and wake-ups, are spread over the calls it serves).
//
//   node loadgen.js --target 127.0.0.1:50061 --method deposit --concurrency 8 --duration 5 \
//        --warmup 1 --keys new --accounts accounts.json [--record keys.jsonl] [--protocol http] \
//        [--rate 500]
//
// Methods: deposit | transfer | transfer_e2e (Transfer, then GetTransfer with wait_for_completion_ms
// until the transfer leaves PENDING: the credit landed on the destination shard; gRPC only).
// Over HTTP: deposit = POST /v1/deposits, transfer = POST /v1/transfers, with the JSON body the
// front maps to the same request message the gRPC mode sends (reference "bench"), the key in the
// Idempotency-Key header and the caller in X-Caller-Id (the router believes it in dev mode only).
// Key modes: new (a fresh UUIDv7 per call) | list:FILE (JSON lines {key, account, amount, dst[, body]}
// replayed in order, wrapping around; over HTTP a recorded `body` is sent byte for byte) |
// fixed:KEY (every call sends KEY).
// --expect CODE counts that answer as the operation instead of OK: a gRPC status name (ABORTED), or
// over HTTP a status number (409). Over HTTP, 200/201 count as `ok` and 409 as `conflicts`, each on
// its own; every other status (or a transport error code) is an error.
// Prints one JSON summary on stdout (with the window's few slowest calls, by key). On stderr it prints "window-start" and "window-end" when the
// measured window opens and closes, so the caller can sample the servers' CPU over that window only.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const http = require('http');

function parseArgs(argv) {
  const opts = {
    target: '127.0.0.1:50061',
    method: 'deposit',
    concurrency: 1,
    duration: 5,
    warmup: 1,
    keys: 'new',
    accounts: '',
    dstAccounts: '',
    amount: 0, // 0: random 1..1000 per call
    caller: 'bench',
    deadlineMs: 10000,
    waitMs: 10000,
    channels: 0, // 0: min(concurrency, 4)
    maxOps: 0, // 0: no bound besides the duration
    rate: 0, // calls started per second across all workers (0: each worker sends as soon as answered)
    record: '',
    expect: 'OK', // the answer that counts as the cell's operation (ABORTED / 409 for the conflict cells)
    protocol: 'grpc', // grpc | http
    protoRoot: path.resolve(__dirname, '..', '..', 'proto'),
  };
  for (let i = 2; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    if (!(name in opts)) throw new Error(`unknown option ${argv[i]}`);
    const value = argv[i + 1];
    if (value === undefined) throw new Error(`option ${argv[i]} needs a value`);
    opts[name] = typeof opts[name] === 'number' ? Number(value) : value;
  }
  if (!['deposit', 'transfer', 'transfer_e2e'].includes(opts.method)) throw new Error(`unknown method ${opts.method}`);
  if (!(opts.concurrency >= 1) || !(opts.duration > 0) || !(opts.warmup >= 0)) throw new Error('bad concurrency/duration/warmup');
  if (!(opts.rate >= 0)) throw new Error('bad rate');
  if (!['grpc', 'http'].includes(opts.protocol)) throw new Error(`unknown protocol ${opts.protocol}`);
  if (opts.protocol === 'http' && opts.method === 'transfer_e2e') throw new Error('transfer_e2e is gRPC only');
  if (opts.protocol === 'http' && !(opts.expect === 'OK' || /^[1-5][0-9][0-9]$/.test(opts.expect))) {
    throw new Error(`over HTTP --expect is OK or a status number, not ${opts.expect}`);
  }
  return opts;
}

// UUIDv7 (RFC 9562): 48-bit Unix ms timestamp, version 7, 12 + 62 random bits, variant 0b10.
function uuidv7() {
  const b = crypto.randomBytes(16);
  const ms = Date.now();
  b[0] = Math.floor(ms / 2 ** 40) & 0xff;
  b[1] = Math.floor(ms / 2 ** 32) & 0xff;
  b[2] = (ms >>> 24) & 0xff;
  b[3] = (ms >>> 16) & 0xff;
  b[4] = (ms >>> 8) & 0xff;
  b[5] = ms & 0xff;
  b[6] = (b[6] & 0x0f) | 0x70;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = b.toString('hex');
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

function readJsonList(file) {
  if (!file) return [];
  const text = fs.readFileSync(file, 'utf8').trim();
  if (text.startsWith('[')) return JSON.parse(text);
  return text.split('\n').filter(Boolean).map((l) => JSON.parse(l));
}

function percentile(sorted, q) {
  if (sorted.length === 0) return 0;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1));
  return sorted[i];
}

function summary(samples) {
  const s = Float64Array.from(samples).sort();
  let sum = 0;
  for (const v of s) sum += v;
  return {
    count: s.length,
    mean_ms: s.length ? sum / s.length : 0,
    p50_ms: percentile(s, 0.5),
    p90_ms: percentile(s, 0.9),
    p99_ms: percentile(s, 0.99),
    p999_ms: percentile(s, 0.999),
    max_ms: s.length ? s[s.length - 1] : 0,
  };
}

// The JSON body the HTTP front turns into the same DepositRequest / TransferRequest the gRPC mode
// sends (proto3 JSON: lowerCamelCase names, int64 as a string).
function httpBody(method, op) {
  const amount = { amountMinor: String(op.amount), currency: 'EUR' };
  if (method === 'deposit') return JSON.stringify({ accountId: op.account, amount, reference: 'bench' });
  return JSON.stringify({ sourceAccountId: op.account, destinationAccountId: op.dst, amount, reference: 'bench' });
}

// One HTTP request on the keep-alive agent; resolves {status, replayed} or {error} (never rejects).
// The answer's body is read to its end so the connection goes back to the agent for the next call.
function httpCall(agent, opts, urlPath, body, key) {
  const [host, port] = [opts.target.slice(0, opts.target.lastIndexOf(':')), Number(opts.target.slice(opts.target.lastIndexOf(':') + 1))];
  const headers = { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) };
  if (key) headers['Idempotency-Key'] = key;
  if (opts.caller) headers['X-Caller-Id'] = opts.caller;
  return new Promise((resolve) => {
    let settled = false;
    const done = (v) => { if (!settled) { settled = true; resolve(v); } };
    const req = http.request({ agent, host, port, method: 'POST', path: urlPath, headers }, (res) => {
      res.on('data', () => {});
      res.on('end', () => done({ status: res.statusCode, replayed: res.headers['idempotent-replayed'] === 'true' }));
      res.on('error', (err) => done({ error: err.code || 'RESPONSE_ERROR' }));
    });
    req.setTimeout(opts.deadlineMs, () => req.destroy(Object.assign(new Error('timeout'), { code: 'TIMEOUT' })));
    req.on('error', (err) => done({ error: err.code || 'REQUEST_ERROR' }));
    req.end(body);
  });
}

function main() {
  const opts = parseArgs(process.argv);
  const useHttp = opts.protocol === 'http';
  let grpc = null;
  let clients = [];
  let agent = null;
  if (useHttp) {
    agent = new http.Agent({ keepAlive: true, maxSockets: opts.concurrency, maxFreeSockets: opts.concurrency });
  } else {
    grpc = require('@grpc/grpc-js');
    const protoLoader = require('@grpc/proto-loader');
    const def = protoLoader.loadSync(path.join(opts.protoRoot, 'shardrouter/v1/transfer.proto'), {
      includeDirs: [opts.protoRoot],
      keepCase: true,
      longs: String,
      enums: String,
      defaults: true,
    });
    const Service = grpc.loadPackageDefinition(def).shardrouter.v1.TransferService;
    const nChannels = opts.channels > 0 ? opts.channels : Math.min(opts.concurrency, 4);
    // A private subchannel pool per client: otherwise grpc-js shares one connection among them.
    clients = Array.from({ length: nChannels }, () =>
      new Service(opts.target, grpc.credentials.createInsecure(), { 'grpc.use_local_subchannel_pool': 1 }),
    );
  }

  const accounts = readJsonList(opts.accounts);
  const dstAccounts = readJsonList(opts.dstAccounts);
  let replayList = [];
  let fixedKey = '';
  if (opts.keys.startsWith('list:')) replayList = readJsonList(opts.keys.slice(5));
  else if (opts.keys.startsWith('fixed:')) fixedKey = opts.keys.slice(6);
  else if (opts.keys !== 'new') throw new Error(`unknown key mode ${opts.keys}`);
  if (opts.keys.startsWith('list:') && replayList.length === 0) throw new Error('empty replay list');
  if (!replayList.length && !accounts.length) throw new Error('--accounts is required');
  if (opts.method !== 'deposit' && !replayList.length && accounts.length < 2 && !dstAccounts.length) {
    throw new Error('transfers need two accounts');
  }

  let replayNext = 0;
  const pick = (list) => list[Math.floor(Math.random() * list.length)];
  // The next operation: its key and request fields. A replay resends exactly what was recorded,
  // so the shard sees the identical request (same hash) and answers from its stored outcome.
  function nextOp() {
    if (replayList.length) {
      const op = replayList[replayNext];
      replayNext = (replayNext + 1) % replayList.length;
      return op;
    }
    const account = pick(accounts);
    let dst = '';
    if (opts.method !== 'deposit') {
      const pool = dstAccounts.length ? dstAccounts : accounts;
      do dst = pick(pool); while (dst === account);
    }
    const amount = opts.amount > 0 ? opts.amount : 1 + Math.floor(Math.random() * 1000);
    const op = { key: fixedKey || uuidv7(), account, dst, amount };
    if (useHttp) op.body = httpBody(opts.method, op);
    return op;
  }

  function call(client, name, request, key) {
    const md = new grpc.Metadata();
    if (key) md.set('idempotency-key', key);
    if (opts.caller) md.set('x-caller-id', opts.caller);
    return new Promise((resolve) => {
      client[name](request, md, { deadline: Date.now() + opts.deadlineMs }, (err, reply) => resolve({ err, reply }));
    });
  }

  const now = () => Number(process.hrtime.bigint()) / 1e6; // ms
  const t0 = now();
  const windowStart = t0 + opts.warmup * 1000;
  const windowEnd = windowStart + opts.duration * 1000;
  // Hard stop for calls still in flight at the end (deadline plus the e2e wait).
  const hardEnd = windowEnd + opts.deadlineMs + (opts.method === 'transfer_e2e' ? opts.waitMs : 0) + 2000;
  const latencies = [];
  const creditLag = [];
  const transferLat = [];
  const errors = {};
  const recorded = [];
  let ok = 0;
  let ops = 0; // answers of the expected kind (= ok unless --expect)
  let conflicts = 0; // HTTP 409s
  let replayed = 0; // HTTP answers with Idempotent-Replayed: true
  let started = 0;
  let cpuStart = null;
  let cpuEnd = null;
  const MAX_SAMPLES = 5_000_000;
  // The few slowest calls of the window, by key, so a tail can be looked up in the servers' logs.
  const SLOWEST_KEPT = 5;
  const slowest = [];
  function noteSlow(op, begin, end, status) {
    const ms = end - begin;
    if (slowest.length === SLOWEST_KEPT && ms <= slowest[SLOWEST_KEPT - 1].ms) return;
    slowest.push({ key: op.key, account: op.account, ms: Math.round(ms * 10) / 10, at_ms: Math.round(begin - windowStart), status });
    slowest.sort((a, b) => b.ms - a.ms);
    if (slowest.length > SLOWEST_KEPT) slowest.pop();
  }

  const windowTimer = setTimeout(() => {
    cpuStart = process.cpuUsage();
    process.stderr.write('window-start\n');
  }, Math.max(0, windowStart - now()));
  const endTimer = setTimeout(() => {
    cpuEnd = process.cpuUsage(cpuStart || undefined);
    process.stderr.write('window-end\n');
  }, Math.max(0, windowEnd - now()));

  // --rate: calls start on a shared schedule, one every 1/rate s; a worker waits for the next free
  // start, and a schedule fallen behind (the servers slower than the rate) starts at once, never
  // in a burst to catch up. The workers still bound the calls in flight.
  let nextStart = 0;
  function paced() {
    const t = Math.max(nextStart, now());
    nextStart = t + 1000 / opts.rate;
    const wait = t - now();
    return wait > 0 ? new Promise((resolve) => setTimeout(resolve, wait)) : null;
  }

  const httpPath = opts.method === 'deposit' ? '/v1/deposits' : '/v1/transfers';
  const httpExpected = opts.expect === 'OK' ? null : Number(opts.expect);

  async function httpWorker() {
    while (now() < windowEnd && (opts.maxOps === 0 || started < opts.maxOps)) {
      started += 1;
      if (opts.rate > 0) await paced();
      const op = nextOp();
      const begin = now();
      // A replayed operation is resent exactly: its recorded body, else the body its fields make.
      const result = await httpCall(agent, opts, httpPath, op.body || httpBody(opts.method, op), op.key);
      const end = now();
      if (begin < windowStart || end > windowEnd) continue; // outside the measured window
      const status = result.error ? result.error : result.status;
      noteSlow(op, begin, end, String(status));
      const isOk = status === 200 || status === 201;
      if (isOk) ok += 1;
      else if (status === 409) conflicts += 1;
      const counted = httpExpected === null ? isOk : status === httpExpected;
      if (counted) {
        ops += 1;
        if (result.replayed) replayed += 1;
        if (latencies.length < MAX_SAMPLES) latencies.push(end - begin);
        if (opts.record && recorded.length < MAX_SAMPLES) recorded.push(op);
      } else if (!isOk && status !== 409) {
        errors[String(status)] = (errors[String(status)] || 0) + 1;
      }
    }
  }

  async function worker(w) {
    if (useHttp) return httpWorker();
    const client = clients[w % clients.length];
    while (now() < windowEnd && (opts.maxOps === 0 || started < opts.maxOps)) {
      started += 1;
      if (opts.rate > 0) await paced();
      const op = nextOp();
      const begin = now();
      let result;
      let landed = null;
      if (opts.method === 'deposit') {
        result = await call(client, 'Deposit', {
          account_id: op.account,
          amount: { amount_minor: op.amount, currency: 'EUR' },
          reference: 'bench',
        }, op.key);
      } else {
        result = await call(client, 'Transfer', {
          source_account_id: op.account,
          destination_account_id: op.dst,
          amount: { amount_minor: op.amount, currency: 'EUR' },
          reference: 'bench',
        }, op.key);
        if (!result.err && opts.method === 'transfer_e2e') {
          const accepted = now();
          const t = result.reply.transfer;
          let state = t.state;
          // Bounded: at most a few waits, each capped by wait_for_completion_ms on the server.
          for (let i = 0; i < 3 && state === 'TRANSFER_STATE_PENDING'; i++) {
            const got = await call(client, 'GetTransfer', {
              source_account_id: op.account,
              transfer_id: t.transfer_id,
              wait_for_completion_ms: opts.waitMs,
            }, '');
            if (got.err) { result = got; break; }
            state = got.reply.transfer.state;
          }
          if (!result.err && state !== 'TRANSFER_STATE_COMPLETED') {
            result = { err: { code: -1, details: `transfer ended ${state}` } };
          }
          if (!result.err) landed = now() - accepted;
          if (begin >= windowStart && !result.err) transferLat.push(accepted - begin);
        }
      }
      const end = now();
      if (begin < windowStart || end > windowEnd) continue; // outside the measured window
      const expected = opts.expect !== 'OK' && result.err && grpc.status[result.err.code] === opts.expect;
      noteSlow(op, begin, end, result.err ? (grpc.status[result.err.code] || String(result.err.code)) : 'OK');
      if (result.err && !expected) {
        const code = result.err.code === -1 ? 'NOT_COMPLETED' : (grpc.status[result.err.code] || String(result.err.code));
        errors[code] = (errors[code] || 0) + 1;
      } else {
        ok += 1;
        ops += 1;
        if (latencies.length < MAX_SAMPLES) latencies.push(end - begin);
        if (landed !== null) creditLag.push(landed);
        if (opts.record && recorded.length < MAX_SAMPLES) recorded.push(op);
      }
    }
  }

  const hard = setTimeout(() => {
    process.stderr.write('loadgen: calls still open at the hard stop; exiting\n');
    finish(true);
  }, hardEnd - now());

  let finished = false;
  function finish(aborted) {
    if (finished) return;
    finished = true;
    clearTimeout(hard);
    clearTimeout(windowTimer);
    clearTimeout(endTimer);
    if (cpuEnd === null) cpuEnd = process.cpuUsage(cpuStart || undefined);
    if (opts.record) fs.writeFileSync(opts.record, recorded.map((o) => JSON.stringify(o)).join('\n') + '\n');
    const elapsed = Math.min(now(), windowEnd) - windowStart;
    const out = {
      target: opts.target,
      protocol: opts.protocol,
      method: opts.method,
      concurrency: opts.concurrency,
      key_mode: opts.keys.split(':')[0],
      expect: opts.expect,
      window_s: Math.max(elapsed, 1) / 1000,
      ok,
      ops,
      errors,
      throughput: ops / (Math.max(elapsed, 1) / 1000),
      latency: summary(latencies),
      slowest,
      cpu_s: (cpuEnd.user + cpuEnd.system) / 1e6,
      max_rss_kb: process.resourceUsage().maxRSS,
      aborted: Boolean(aborted),
    };
    if (useHttp) {
      out.conflicts = conflicts;
      out.replayed = replayed;
    }
    if (opts.method === 'transfer_e2e') {
      out.credit_lag = summary(creditLag);
      out.transfer_latency = summary(transferLat);
    }
    process.stdout.write(JSON.stringify(out) + '\n');
    for (const c of clients) c.close();
    if (agent) agent.destroy();
    process.exit(0);
  }

  Promise.all(Array.from({ length: opts.concurrency }, (_, w) => worker(w))).then(() => finish(false));
}

try {
  main();
} catch (err) {
  process.stderr.write(`loadgen: ${err.message}\n`);
  process.exit(2);
}
