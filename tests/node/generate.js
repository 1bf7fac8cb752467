#!/usr/bin/env node
// A Node.js client of the pdserve gateway, built from protos/ at run time (no generated
// code): GetModelInfo, then one streamed greedy Generate that survives its gateway.
//
//   node tests/node/generate.js <host:port>[,<host:port>...] [prompt] [--max-tokens N]
//                               [--ignore-eos]
//
// Several comma-separated gateways (one fleet's): when a stream breaks before its last
// message (the gateway died, the connection dropped), the same request goes to the next
// gateway after a backoff, with the last message's resume_token and every token received,
// and the stream goes on with nothing lost or repeated.
//
// Prints one JSON object on stdout:
//   {model_info, request_id, tokens, text, finish_reason, usage, resumes}
// On a failed call, prints {code, details} on stderr and exits 1.
'use strict';

const path = require('node:path');
const { promisify } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const DEADLINE_MS = 120_000;
const DEFAULT_PROMPT = 'Name three colors of the rainbow.';

function loadGatewayService() {
  const definition = protoLoader.loadSync('pdserve/gateway/v1/gateway.proto', {
    includeDirs: [PROTOS],
    keepCase: true, // field names as written in the .proto: max_tokens, token_ids
    enums: String, // FINISH_REASON_STOP rather than 1
    longs: String,
    defaults: true, // unset fields read as their zero values, repeated ones as []
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pdserve.gateway.v1.GatewayService;
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

// A call that ends with one of these before its last message broke on the way: resume it.
const RESUMABLE = new Set([
  grpc.status.UNAVAILABLE, grpc.status.UNKNOWN, grpc.status.INTERNAL, grpc.status.ABORTED,
]);
const BACKOFF = { firstMs: 100, maxMs: 2000, attempts: 8 };

function backoffMs(attempt) {
  // Doubling up to maxMs, scaled by a random factor in [0.5, 1]: the clients of one dead
  // gateway do not all come back at the same moment.
  const base = Math.min(BACKOFF.maxMs, BACKOFF.firstMs * 2 ** attempt);
  return base * (0.5 + Math.random() / 2);
}

async function generate(clients, prompt, maxTokens, ignoreEos) {
  const request = {
    prompt,
    // temperature is a proto3 `optional`: 0 is sent explicitly and means greedy.
    sampling: { temperature: 0, max_tokens: maxTokens, ignore_eos: ignoreEos },
  };
  const result = {
    request_id: '', tokens: [], text: '', finish_reason: null, usage: null, resumes: 0,
  };
  let resumeToken = '';
  let current = 0;
  for (let attempt = 0; ; attempt += 1) {
    const call = resumeToken
      ? { ...request, resume: { resume_token: resumeToken, token_ids: [...result.tokens] } }
      : request;
    try {
      for await (const message of clients[current].Generate(call, { deadline: deadline() })) {
        result.request_id = message.request_id;
        result.tokens.push(...message.token_ids.map(Number));
        result.text += message.text;
        resumeToken = message.resume_token || resumeToken;
        if (message.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
          result.finish_reason = message.finish_reason;
          result.usage = message.usage;
        }
      }
      return result;
    } catch (error) {
      if (!RESUMABLE.has(error.code) || attempt >= BACKOFF.attempts) throw error;
      // Tokens came but no resume token with them: a gateway that keeps no resume records.
      if (result.tokens.length > 0 && !resumeToken) throw error;
    }
    await new Promise((resolve) => setTimeout(resolve, backoffMs(attempt)));
    current = (current + 1) % clients.length;
    if (resumeToken) result.resumes += 1;
  }
}

function parseArgs(argv) {
  const positional = [];
  const options = { maxTokens: 16, ignoreEos: false };
  for (let i = 0; i < argv.length; i += 1) {
    if (argv[i] === '--max-tokens') {
      options.maxTokens = Number.parseInt(argv[(i += 1)], 10);
    } else if (argv[i] === '--ignore-eos') {
      options.ignoreEos = true;
    } else {
      positional.push(argv[i]);
    }
  }
  const [target, prompt = DEFAULT_PROMPT] = positional;
  return { target, prompt, ...options };
}

async function main() {
  const { target, prompt, maxTokens, ignoreEos } = parseArgs(process.argv.slice(2));
  if (!target || !(maxTokens > 0)) {
    process.stderr.write(
      'usage: node generate.js <host:port>[,<host:port>...] [prompt] [--max-tokens N] ' +
        '[--ignore-eos]\n',
    );
    return 2;
  }
  const GatewayService = loadGatewayService();
  const clients = target
    .split(',')
    .filter((t) => t.trim())
    .map((t) => new GatewayService(t.trim(), grpc.credentials.createInsecure()));
  try {
    const getModelInfo = promisify(clients[0].GetModelInfo.bind(clients[0]));
    const modelInfo = await getModelInfo({}, { deadline: deadline() });
    const result = await generate(clients, prompt, maxTokens, ignoreEos);
    process.stdout.write(`${JSON.stringify({ model_info: modelInfo, ...result })}\n`);
    return 0;
  } catch (error) {
    const code = grpc.status[error.code] ?? String(error.code);
    process.stderr.write(`${JSON.stringify({ code, details: error.details ?? String(error) })}\n`);
    return 1;
  } finally {
    for (const client of clients) client.close();
  }
}

main().then((code) => {
  process.exitCode = code;
});
