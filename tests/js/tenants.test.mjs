// A tenant's Node.js client against a nats-server with the config of `plexrl nats-config`: the
// broker refuses what the tenant's nkey may not do, and lets it do its own things.
//
// Run by tests/bus/test_auth_broker.py, which starts the server and sets
//   PLEXRL_TEST_NATS_URL       the server
//   PLEXRL_TEST_SEED           the tenant's seed file (plexrl tenants add NAME)
//   PLEXRL_TEST_TENANT         that tenant's name
//   PLEXRL_TEST_OTHER_TENANT   another tenant, whose subjects it must not reach
// Without them (a plain `node --test` in tests/js) every test here is skipped.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { connect, nkeyAuthenticator } from '@nats-io/transport-node';
import { jetstream, jetstreamManager } from '@nats-io/jetstream';

const url = process.env.PLEXRL_TEST_NATS_URL;
const tenant = process.env.PLEXRL_TEST_TENANT;
const other = process.env.PLEXRL_TEST_OTHER_TENANT;
const skip = url ? false : 'needs PLEXRL_TEST_NATS_URL (run by tests/bus/test_auth_broker.py)';

async function connectAsTenant() {
  const seed = new TextEncoder().encode(readFileSync(process.env.PLEXRL_TEST_SEED, 'utf8').trim());
  const nc = await connect({
    servers: url,
    authenticator: nkeyAuthenticator(seed),
    inboxPrefix: `_INBOX_${tenant}`, // the only inboxes the tenant may subscribe to
    maxReconnectAttempts: 0,
  });
  const violations = [];
  (async () => {
    for await (const s of nc.status()) {
      if (s.type === 'error' && s.error?.name === 'PermissionViolationError') violations.push(s.error);
    }
  })();
  // Resolves with the broker's permission violation for `subject`, or fails after a few seconds.
  const violation = async (subject) => {
    for (let i = 0; i < 150; i++) {
      const found = violations.find((e) => e.subject === subject);
      if (found) return found;
      await new Promise((r) => setTimeout(r, 20));
    }
    assert.fail(`no permission violation for ${subject}: ${violations.map((e) => e.message)}`);
  };
  return { nc, violation };
}

// Runs `body` on a fresh tenant connection and closes it whatever happens, so that a failing
// assertion fails the test instead of leaving the process waiting on an open connection.
async function asTenant(body) {
  const client = await connectAsTenant();
  try {
    await body(client);
  } finally {
    await client.nc.close();
  }
}

test('publishing on another tenant\'s submit subject is refused', { skip }, () =>
  asTenant(async ({ nc, violation }) => {
    const subject = `plexrl.runs.${other}.submit`;
    const js = jetstream(nc, { timeout: 1000 });
    await assert.rejects(js.publish(subject, JSON.stringify({ type: 'run_submitted', run_id: 'run_x' })));
    assert.equal((await violation(subject)).operation, 'publish');
  }));

test('a consumer on another tenant\'s runs is refused', { skip }, () =>
  asTenant(async ({ nc, violation }) => {
    const jsm = await jetstreamManager(nc, { checkAPI: false, timeout: 1000 });
    const filter = `plexrl.runs.${other}.>`;
    await assert.rejects(
      jsm.consumers.add('PLEXRL_RUNS', { name: 'spy', filter_subject: filter, ack_policy: 'none' }),
    );
    const refused = await violation(`$JS.API.CONSUMER.CREATE.PLEXRL_RUNS.spy.${filter}`);
    assert.equal(refused.operation, 'publish');
  }));

test('subscribing to another tenant\'s weights is refused', { skip }, () =>
  asTenant(async ({ nc, violation }) => {
    const subject = `plexrl.weights.${other}.>`;
    const sub = nc.subscribe(subject);
    const refused = await violation(subject);
    assert.equal(refused.operation, 'subscription');
    const closed = await sub.closed;
    assert.equal(closed?.name, 'PermissionViolationError');
  }));

test('the tenant publishes on its own submit subject and gets a PubAck', { skip }, () =>
  asTenant(async ({ nc }) => {
    const js = jetstream(nc);
    const submit = { type: 'run_submitted', schema_version: 1, run_id: 'run_node', config: {} };
    const ack = await js.publish(`plexrl.runs.${tenant}.submit`, JSON.stringify(submit));
    assert.equal(ack.stream, 'PLEXRL_RUNS');
    assert.ok(ack.seq > 0);
  }));

// Requests and publishes of another tenant's runs, the default tenant's, and the services'
// internals: the broker refuses each one, so no service ever sees it.
const denied = () => [
  `plexrl.runs.${other}.evict`,
  `plexrl.rollouts.${other}.run_x`,
  `plexrl.inference.${other}.generate`,
  `plexrl.registry.${other}.list`,
  `plexrl.train.${other}.forward_backward`,
  `plexrl.train.${other}.optim_step`,
  'plexrl.train.forward_backward',
  'plexrl.inference.generate',
  'plexrl.runs.evict',
  '$JS.API.STREAM.NAMES',
  '$JS.API.STREAM.INFO.KV_plexrl-registry',
  `$JS.API.STREAM.INFO.OBJ_plexrl-weights-${other}`,
];

test('requests on another tenant\'s or the services\' subjects are refused', { skip }, () =>
  asTenant(async ({ nc, violation }) => {
    for (const subject of denied()) {
      await assert.rejects(nc.request(subject, '{}', { timeout: 500 }), subject);
      assert.equal((await violation(subject)).operation, 'publish', subject);
    }
  }));
