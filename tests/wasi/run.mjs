// Runs a wasm32-wasip1 test binary under Node's WASI, with the V8 engine
// Envoy uses: `cargo test --target wasm32-wasip1` calls it as the runner
// (see .cargo/config.toml). Arguments after the module pass to libtest.
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import { argv, env, exit } from "node:process";

const [module, ...args] = argv.slice(2);
const wasi = new WASI({ version: "preview1", args: [module, ...args], env, returnOnExit: true });
const { instance } = await WebAssembly.instantiate(await readFile(module), wasi.getImportObject());
exit(wasi.start(instance));
