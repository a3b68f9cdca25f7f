// Validates Kubernetes and Istio manifests offline against their schemas
// (Istio's CRD schemas from @kubernetes-models/istio, Kubernetes' from
// kubernetes-models). Usage: node validate-manifests.mjs [--expect-invalid] FILE...
// Every document must be of a known kind; with --expect-invalid, every FILE
// must hold at least one document the schemas refuse.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";
import { WasmPlugin } from "@kubernetes-models/istio/extensions.istio.io/v1alpha1/WasmPlugin";
import { ConfigMap, Namespace, Service } from "kubernetes-models/v1";
import { Deployment } from "kubernetes-models/apps/v1";

const models = { WasmPlugin, ConfigMap, Namespace, Service, Deployment };

function errorsOf(file) {
  const errors = [];
  const docs = parseAllDocuments(readFileSync(file, "utf8"));
  docs.forEach((doc, index) => {
    const where = `${file} document ${index + 1}`;
    if (doc.errors.length > 0) {
      errors.push(`${where}: YAML: ${doc.errors[0].message}`);
      return;
    }
    const data = doc.toJS();
    if (data === null) return;
    const Model = models[data.kind];
    if (!Model) {
      errors.push(`${where}: no schema for kind ${JSON.stringify(data.kind)}`);
      return;
    }
    try {
      new Model(data).validate();
    } catch (err) {
      errors.push(`${where} (${data.kind} ${data.metadata?.name}): ${err.message}`);
    }
  });
  return errors;
}

const args = process.argv.slice(2);
const expectInvalid = args[0] === "--expect-invalid";
const files = expectInvalid ? args.slice(1) : args;
if (files.length === 0) {
  console.error("no files given");
  process.exit(2);
}
let failed = 0;
for (const file of files) {
  const errors = errorsOf(file);
  if (expectInvalid) {
    if (errors.length === 0) {
      console.error(`${file}: accepted, but it is an invalid example`);
      failed++;
    } else {
      console.log(`refused as expected: ${errors[0]}`);
    }
  } else if (errors.length > 0) {
    errors.forEach((e) => console.error(e));
    failed++;
  } else {
    console.log(`valid: ${file}`);
  }
}
process.exit(failed === 0 ? 0 : 1);
