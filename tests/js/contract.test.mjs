// plexrl's event contract, read by another language: every valid example passes its event's
// JSON Schema under Ajv, every invalid one fails, and the AsyncAPI document parses cleanly.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import test from 'node:test';
import { fileURLToPath } from 'node:url';

import { Parser } from '@asyncapi/parser';
import Ajv2020 from 'ajv/dist/2020.js';

const schemasDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../schemas');
const examplesDir = path.join(schemasDir, 'examples');

// strict: false because the schemas carry annotations Ajv does not know (contentEncoding).
const ajv = new Ajv2020({ strict: false, allErrors: true });

function readJson(file) {
  return JSON.parse(fs.readFileSync(file, 'utf8'));
}

function validatorFor(tag) {
  const schema = readJson(path.join(schemasDir, 'json', `${tag}.json`));
  return ajv.getSchema(schema.$id) ?? ajv.compile(schema);
}

const versionDirs = fs
  .readdirSync(examplesDir)
  .filter((name) => /^v\d+$/.test(name))
  .map((name) => path.join(examplesDir, name));

for (const versionDir of versionDirs) {
  for (const tag of fs.readdirSync(versionDir).sort()) {
    const tagDir = path.join(versionDir, tag);
    const files = fs.readdirSync(tagDir).sort();
    const valid = files.filter((f) => f.startsWith('valid_'));
    const invalid = files.filter((f) => f.startsWith('invalid_'));

    test(`${path.basename(versionDir)}/${tag}: valid examples pass`, () => {
      assert.ok(valid.length >= 1);
      const validate = validatorFor(tag);
      for (const f of valid) {
        const doc = readJson(path.join(tagDir, f));
        assert.equal(validate(doc), true, `${f}: ${ajv.errorsText(validate.errors)}`);
        assert.equal(doc.type, tag);
      }
    });

    test(`${path.basename(versionDir)}/${tag}: invalid examples fail`, () => {
      const validate = validatorFor(tag);
      for (const f of invalid) {
        assert.equal(validate(readJson(path.join(tagDir, f))), false, `${f} was accepted`);
      }
    });
  }
}

// The KV records (plexrl-registry, plexrl-progress): untagged, checked the same way.
const recordsDir = path.join(examplesDir, 'records');
for (const name of fs.readdirSync(recordsDir).sort()) {
  const dir = path.join(recordsDir, name);
  const files = fs.readdirSync(dir).sort();
  test(`records/${name}: valid examples pass, invalid ones fail`, () => {
    const validate = validatorFor(name);
    const valid = files.filter((f) => f.startsWith('valid_'));
    const invalid = files.filter((f) => f.startsWith('invalid_'));
    assert.ok(valid.length >= 2 && invalid.length >= 4);
    for (const f of valid) {
      assert.equal(validate(readJson(path.join(dir, f))), true, `${f}: ${ajv.errorsText(validate.errors)}`);
    }
    for (const f of invalid) {
      assert.equal(validate(readJson(path.join(dir, f))), false, `${f} was accepted`);
    }
  });
}

test('a run id with a trailing newline is rejected', () => {
  const validate = validatorFor('run_forgotten');
  assert.equal(validate({ type: 'run_forgotten', run_id: 'run_a', idx: 1 }), true);
  assert.equal(validate({ type: 'run_forgotten', run_id: 'run_a\n', idx: 1 }), false);
  assert.equal(validate({ type: 'run_forgotten', run_id: 'run_a', idx: 1, extra: true }), true);
});

test('the orch config schema forbids unknown keys', () => {
  const validate = validatorFor('orch_config');
  assert.equal(validate({ env: 'reverse', model: { lora: { rank: 8 } } }), true);
  assert.equal(validate({ env: 'reverse', optim: { learning_rate: 0.001 } }), false);
  assert.equal(validate({ model: { lora: { rank: 1000 } } }), false);
});

test('asyncapi.yaml is a valid AsyncAPI 3 document', async () => {
  const text = fs.readFileSync(path.join(schemasDir, 'asyncapi.yaml'), 'utf8');
  const { document, diagnostics } = await new Parser().parse(text);
  const errors = diagnostics.filter((d) => d.severity === 0);
  assert.deepEqual(errors, []);
  assert.ok(document);
  const addresses = document.channels().all().map((c) => c.address()).filter(Boolean).sort();
  assert.ok(addresses.includes('plexrl.rollouts.{run_id}'));
  assert.ok(addresses.includes('plexrl.inference.generate'));
  assert.ok(addresses.includes('plexrl.registry.list'));
  assert.ok(addresses.includes('{progress_subject}'));
  assert.ok(addresses.includes('plexrl.ingest.{tenant}.submit'));
  assert.equal(document.operations().all().length, 50);
});
