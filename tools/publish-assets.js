#!/usr/bin/env node
// Publishes (or lists) the assets of one CDK asset manifest (<stack>.assets.json), for the pipeline's
// Build action: what the `cdk-assets` CLI does (aws/aws-cdk-cli packages/cdk-assets/bin/publish.ts and
// list.ts), on @aws-cdk/cdk-assets-lib, the library that CLI wraps.
//
// Why not the `cdk-assets` CLI itself: its newest release (4.7.3) bundles cloud-assembly-schema 54 and
// refuses the manifests aws-cdk-lib 2.275.0 writes ("Cloud assembly schema version mismatch: Maximum
// schema version supported is 54.x.x, but found 55.0.0"); the library takes the schema as a dependency,
// pinned in package.json at a version that reads 55 (docs/rollout-pipeline.md, "Publishing assets").
//
// Like the CLI, publishing assumes only the publishing role each destination of the manifest names
// (the bootstrap file- and image-publishing roles); nothing reads the stack or the bootstrap version.
//
// Usage: node tools/publish-assets.js ls|publish <path/to/stack.assets.json>
'use strict';

const { AssetManifest, AssetPublishing, DefaultAwsClient } = require('@aws-cdk/cdk-assets-lib');

const USAGE = 'usage: node tools/publish-assets.js ls|publish <path/to/stack.assets.json>';

function loadManifest(path) {
  try {
    return AssetManifest.fromPath(path);
  } catch (e) {
    console.error(`publish-assets: ${e.message}`);
    process.exit(3);
  }
}

async function publish(manifest) {
  const publishing = new AssetPublishing(manifest, {
    aws: new DefaultAwsClient(),
    progressListener: {
      onPublishEvent(type, event) {
        console.error(`[${event.percentComplete}%] ${type}: ${event.message}`);
      },
    },
    throwOnError: false,
  });
  await publishing.publish();
  for (const failure of publishing.failures) {
    console.error('Failure:', failure.error.message);
  }
  return publishing.hasFailures ? 1 : 0;
}

async function main(argv) {
  const [command, path, ...rest] = argv;
  if (!['ls', 'publish'].includes(command) || !path || rest.length) {
    console.error(USAGE);
    return 2;
  }
  const manifest = loadManifest(path);
  if (command === 'ls') {
    console.log(manifest.list().join('\n'));
    return 0;
  }
  return publish(manifest);
}

main(process.argv.slice(2)).then(
  (code) => { process.exitCode = code; },
  (e) => { console.error(`publish-assets: ${e.message}`); process.exitCode = 1; },
);
