// A tenant's Node.js client against the accounts of `plexrl nats-config` and a real registry:
// it submits and follows its own runs exactly as a Python client does, a malformed message gets
// a clear error, and nothing it names of another tenant's or of the services' reaches anyone.
//
// Run by tests/security/test_node_tenant.py, which starts the server and the registry and sets
//   PLEXRL_TEST_NATS_URL       the server
//   PLEXRL_TEST_SEED           the tenant's seed file (plexrl tenants add NAME)
//   PLEXRL_TEST_TENANT         that tenant's name
//   PLEXRL_TEST_OTHER_TENANT   another tenant, whose subjects it must not reach
// and then checks that the other tenant's stored messages are what they were. Without them (a
// plain `node --test` in tests/js) every test here is skipped.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { connect, nkeyAuthenticator } from '@nats-io/transport-node';
import { jetstream, jetstreamManager } from '@nats-io/jetstream';

const url = process.env.PLEXRL_TEST_NATS_URL;
const tenant = process.env.PLEXRL_TEST_TENANT;
const other = process.env.PLEXRL_TEST_OTHER_TENANT;
const skip = url ? false : 'needs PLEXRL_TEST_NATS_URL (run by tests/security/test_node_tenant.py)';

const config = {
  env: 'reverse',
  max_steps: 5,
  driver: 'commands',
  model: { lora: { rank: 4, alpha: 8 } },
};

// Runs `body` on a fresh tenant connection and closes it whatever happens, so that a failing
// assertion fails the test instead of leaving the process waiting on an open connection.
async function asTenant(body) {
  const seed = new TextEncoder().encode(readFileSync(process.env.PLEXRL_TEST_SEED, 'utf8').trim());
  const nc = await connect({
    servers: url,
    authenticator: nkeyAuthenticator(seed),
    inboxPrefix: `_INBOX_${tenant}`, // where replicas send a tenant's generate progress
    maxReconnectAttempts: 0,
  });
  try {
    await body(nc);
  } finally {
    await nc.close();
  }
}

test('the tenant submits on its own subject, gets a PubAck and follows its run in its view', { skip }, () =>
  asTenant(async (nc) => {
    const js = jetstream(nc);
    const submit = { type: 'run_submitted', schema_version: 1, run_id: 'run_node', config };
    const ack = await js.publish(`plexrl.runs.${tenant}.submit`, JSON.stringify(submit), {
      msgID: 'run_node/submit/1',
    });
    assert.equal(ack.stream, 'PLEXRL_RUNS');
    assert.ok(ack.seq > 0);
    // the registry's answer arrives in the tenant's own stream of its runs' events
    const jsm = await jetstreamManager(nc);
    const subject = `plexrl.runs.${tenant}.discovered`;
    for (let i = 0; i < 300; i++) {
      const found = await jsm.streams.getMessage('PLEXRL_RUNS', { last_by_subj: subject });
      if (found) {
        const event = found.json();
        assert.equal(event.type, 'run_discovered');
        assert.equal(event.run_id, 'run_node');
        assert.equal(event.tenant, tenant);
        return;
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.fail(`no RunDiscovered on ${subject}`);
  }));

test('a malformed submit gets a clear error and nothing is stored', { skip }, () =>
  asTenant(async (nc) => {
    const js = jetstream(nc);
    await assert.rejects(
      js.publish(`plexrl.runs.${tenant}.submit`, '{"type": "run_submitted", "run_id": 7'),
      /not a valid RunSubmitted/,
    );
    await assert.rejects(
      js.publish(`plexrl.runs.${tenant}.evict`, JSON.stringify({ type: 'evict_requested', run_id: 'run_nobody', reason: 'x' })),
      /has no run run_nobody/,
    );
  }));

test('a consumer on another tenant\'s runs finds nothing to read', { skip }, () =>
  asTenant(async (nc) => {
    const jsm = await jetstreamManager(nc, { checkAPI: false, timeout: 2000 });
    const filter = `plexrl.runs.${other}.>`;
    const spy = { name: 'spy', filter_subject: filter, ack_policy: 'none' };
    // the tenant's own PLEXRL_RUNS holds only its own subjects: a consumer there has nothing
    const made = await jsm.consumers.add('PLEXRL_RUNS', spy);
    assert.equal(made.num_pending, 0);
    // and the services' streams are not in its account at all
    await assert.rejects(jsm.consumers.add('PLEXRL_ROLLOUTS', spy), /stream not found/);
    const names = [];
    for await (const s of jsm.streams.list()) names.push(s.config.name);
    assert.deepEqual(names.sort(), ['PLEXRL_RUNS', 'PLEXRL_WEIGHTS']);
  }));

// Another tenant's runs, the default tenant's, and the services' internals: none of these
// subjects exists in the tenant's account, so nothing answers and nothing is delivered.
const denied = () => [
  `plexrl.runs.${other}.submit`,
  `plexrl.runs.${other}.evict`,
  `plexrl.rollouts.${other}.run_x`,
  `plexrl.inference.${other}.generate`,
  `plexrl.registry.${other}.list`,
  `plexrl.train.${other}.forward_backward`,
  `plexrl.ingest.${other}.submit`,
  'plexrl.train.forward_backward',
  'plexrl.inference.generate',
  'plexrl.runs.evict',
  'plexrl.runs.submit',
  `$JS.plexrl.API.DIRECT.GET.OBJ_plexrl-weights-${other}`,
];

test('requests on another tenant\'s or the services\' subjects reach nobody', { skip }, () =>
  asTenant(async (nc) => {
    for (const subject of denied()) {
      await assert.rejects(nc.request(subject, '{}', { timeout: 1000 }), subject);
    }
  }));
