// Load on loopback: 500 concurrent streaming requests of random lengths through the official client, 10 % of
// them abandoned mid-stream. Zero server errors, every request accounted for in the server's counters, and the
// KV-cache pool back to empty once the streams are done.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { API_KEY, startServer, metrics } from './server_process.mjs';

const REQUESTS = Number(process.env.DSV4_LOAD_REQUESTS ?? 500);

// A small deterministic generator so a failure replays (no test on fixed inputs: the seed varies the draw).
function rng(seed) {
  let state = seed >>> 0;
  return () => { state = (state * 1664525 + 1013904223) >>> 0; return state / 2 ** 32; };
}

test(`${REQUESTS} concurrent streams with 10% disconnects`, { timeout: 600000 }, async () => {
  const server = await startServer(['--max-num-seqs', '256', '--max-num-batched-tokens', '4096',
                                    '--max-model-len', '1024']);
  try {
    const client = new OpenAI({ apiKey: API_KEY, baseURL: server.baseURL + '/v1', maxRetries: 0, timeout: 600000 });
    const random = rng(Number(process.env.DSV4_LOAD_SEED ?? 20261202));
    const words = ['alpha', 'beta', 'gamma', 'delta', 'kv', 'cache', '模型', 'données', '🙂', '42', 'sparse'];
    const jobs = [];
    for (let i = 0; i < REQUESTS; ++i) {
      const length = 1 + Math.floor(random() * 60);
      const prompt = Array.from({ length }, () => words[Math.floor(random() * words.length)]).join(' ');
      const maxTokens = 1 + Math.floor(random() * 24);
      const disconnect = random() < 0.1;
      const chat = random() < 0.5;
      jobs.push({ prompt, maxTokens, disconnect, chat });
    }
    const outcomes = await Promise.all(jobs.map(async (job) => {
      const controller = new AbortController();
      const params = { model: 'dsv4-tiny-random', max_tokens: job.maxTokens, temperature: 0.7, seed: 1,
                       stream: true, stream_options: { include_usage: true } };
      let chunks = 0, finish = null, usage = null;
      try {
        const stream = job.chat
          ? await client.chat.completions.create({ ...params, messages: [{ role: 'user', content: job.prompt }] },
                                                 { signal: controller.signal })
          : await client.completions.create({ ...params, prompt: job.prompt }, { signal: controller.signal });
        for await (const chunk of stream) {
          ++chunks;
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices) if (choice.finish_reason) finish = choice.finish_reason;
          if (job.disconnect && chunks >= 2) { controller.abort(); break; }
        }
        return { job, finish, usage, aborted: job.disconnect && finish === null };
      } catch (error) {
        if (job.disconnect && (error.name === 'AbortError' || error instanceof OpenAI.APIUserAbortError))
          return { job, aborted: true };
        return { job, error: String(error) };
      }
    }));
    const errors = outcomes.filter((o) => o.error);
    assert.deepEqual(errors.slice(0, 3).map((o) => o.error), [], `${errors.length} requests failed`);
    for (const o of outcomes.filter((o) => !o.aborted && !o.job.disconnect)) {
      assert.ok(o.finish === 'length' || o.finish === 'stop', JSON.stringify(o));
      assert.ok(o.usage.completion_tokens <= o.job.maxTokens);
      if (o.finish === 'length') assert.equal(o.usage.completion_tokens, o.job.maxTokens);
    }
    const aborted = outcomes.filter((o) => o.aborted).length;
    assert.ok(aborted > REQUESTS * 0.03, `only ${aborted} disconnects happened`);

    // The server notices each disconnect and aborts the request; wait for the engine to go idle.
    let values;
    for (let i = 0; i < 200; ++i) {
      values = await metrics(server.baseURL);
      if (values['dsv4:num_requests_running'] === 0 && values['dsv4:num_requests_waiting'] === 0) break;
      await new Promise((r) => setTimeout(r, 50));
    }
    assert.equal(values['dsv4:num_requests_running'], 0);
    assert.equal(values['dsv4:num_requests_waiting'], 0);
    const finished = ['stop', 'length', 'abort'].reduce(
      (sum, reason) => sum + values[`dsv4:request_success_total{finished_reason="${reason}"}`], 0);
    assert.equal(finished, REQUESTS, 'every request is accounted for');
    assert.ok(values['dsv4:request_success_total{finished_reason="abort"}'] >= 1);
    assert.equal(values['dsv4:request_success_total{finished_reason="error"}'], 0);
    for (const [key, value] of Object.entries(values)) {
      if (key.startsWith('dsv4:http_requests_total{status="5')) assert.equal(value, 0, key);
      if (key.startsWith('dsv4:kv_cache_group_used_blocks')) assert.equal(value, 0, `${key}: blocks still held`);
    }
    assert.equal(values['dsv4:kv_cache_usage_perc'], 0, 'the pool is back to full');
    console.log(`load: ${REQUESTS} streams, ${aborted} disconnected, ${values['dsv4:generation_tokens_total']} ` +
                `tokens generated, prefix-cache hit rate ${values['dsv4:prefix_cache_hit_rate'].toFixed(3)}`);
  } finally {
    assert.equal(await server.stop(), 0);
  }
});
