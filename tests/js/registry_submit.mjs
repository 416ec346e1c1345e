// Submit runs to the plexrl registry from Node.js: a RunSubmitted is plain JSON published through
// JetStream on plexrl.runs.submit; the registry answers with RunDiscovered on
// plexrl.runs.discovered (or RunConfigInvalid on plexrl.runs.invalid).
//
//   node registry_submit.mjs NATS_URL RUN_ID [RUN_ID ...] [--malformed] [--wait SECONDS]
//
// Publishes one RunSubmitted per RUN_ID (with --malformed, a truncated message after the first
// one, which the registry must reject and survive), then with --wait prints each run's index
// as its RunDiscovered arrives. Prints one JSON line per event and exits 0 when done, 1 on a
// timeout or a rejected run. Used by tests/registry/test_node_client.py.
import { connect } from '@nats-io/transport-node';
import { jetstream } from '@nats-io/jetstream';

const args = process.argv.slice(2);
const url = args.shift();
const malformed = args.includes('--malformed');
const waitIdx = args.indexOf('--wait');
const waitSeconds = waitIdx >= 0 ? Number(args[waitIdx + 1]) : 0;
const runIds = args.filter((a, i) => !a.startsWith('--') && (waitIdx < 0 || i !== waitIdx + 1));

const config = {
  env: 'reverse',
  max_steps: 20,
  batch_size: 4,
  group_size: 4,
  model: { lora: { rank: 8, alpha: 16 } },
};

const nc = await connect({ servers: url });
const js = jetstream(nc);

// Subscribe before publishing so no answer can slip past.
const answers = nc.subscribe('plexrl.runs.>');
const pending = new Set(runIds);
let failed = false;
const done = (async () => {
  for await (const m of answers) {
    if (m.subject !== 'plexrl.runs.discovered' && m.subject !== 'plexrl.runs.invalid') continue;
    const event = m.json();
    if (!pending.has(event.run_id)) continue;
    pending.delete(event.run_id);
    if (event.type === 'run_config_invalid') failed = true;
    console.log(JSON.stringify({ answer: event.type, run_id: event.run_id, idx: event.idx, error: event.error }));
    if (pending.size === 0) break;
  }
})();

for (const [i, runId] of runIds.entries()) {
  const submit = { type: 'run_submitted', schema_version: 1, run_id: runId, config, submitted_by: 'node' };
  // Nats-Msg-Id: a retried publish is stored once
  const ack = await js.publish('plexrl.runs.submit', JSON.stringify(submit), { msgID: `${runId}/submit/${Date.now()}` });
  console.log(JSON.stringify({ published: runId, seq: ack.seq }));
  if (malformed && i === 0) {
    const bad = await js.publish('plexrl.runs.submit', '{"type": "run_submitted", "run_id": ');
    console.log(JSON.stringify({ published: 'malformed', seq: bad.seq }));
  }
}

if (waitSeconds > 0) {
  const timer = new Promise((resolve) => setTimeout(() => resolve('timeout'), waitSeconds * 1000));
  if ((await Promise.race([done, timer])) === 'timeout') {
    console.log(JSON.stringify({ timeout: [...pending] }));
    failed = true;
  }
}
answers.unsubscribe();
await nc.drain();
process.exit(failed ? 1 : 0);
