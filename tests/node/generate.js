#!/usr/bin/env node
// A Node.js client of the pdserve gateway, built from protos/ at run time (no generated
// code): GetModelInfo, then one streamed greedy Generate.
//
//   node tests/node/generate.js <host:port> [prompt]
//
// Prints one JSON object on stdout:
//   {model_info, request_id, tokens, text, finish_reason, usage}
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

async function generate(client, prompt) {
  const request = {
    prompt,
    // temperature is a proto3 `optional`: 0 is sent explicitly and means greedy.
    sampling: { temperature: 0, max_tokens: 16 },
  };
  const result = { request_id: '', tokens: [], text: '', finish_reason: null, usage: null };
  for await (const message of client.Generate(request, { deadline: deadline() })) {
    result.request_id = message.request_id;
    result.tokens.push(...message.token_ids);
    result.text += message.text;
    if (message.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      result.finish_reason = message.finish_reason;
      result.usage = message.usage;
    }
  }
  return result;
}

async function main() {
  const [target, prompt = DEFAULT_PROMPT] = process.argv.slice(2);
  if (!target) {
    process.stderr.write('usage: node generate.js <host:port> [prompt]\n');
    return 2;
  }
  const GatewayService = loadGatewayService();
  const client = new GatewayService(target, grpc.credentials.createInsecure());
  try {
    const getModelInfo = promisify(client.GetModelInfo.bind(client));
    const modelInfo = await getModelInfo({}, { deadline: deadline() });
    const result = await generate(client, prompt);
    process.stdout.write(`${JSON.stringify({ model_info: modelInfo, ...result })}\n`);
    return 0;
  } catch (error) {
    const code = grpc.status[error.code] ?? String(error.code);
    process.stderr.write(`${JSON.stringify({ code, details: error.details ?? String(error) })}\n`);
    return 1;
  } finally {
    client.close();
  }
}

main().then((code) => {
  process.exitCode = code;
});
