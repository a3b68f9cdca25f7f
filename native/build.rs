//! Binds every symbol when Envoy loads the module (`-z now`, the default of
//! Rust's Linux targets, made explicit): an Envoy whose ABI lacks a callback
//! the module uses refuses it at load with `undefined symbol: <callback>`
//! rather than failing at the first call (see `native/ABI.md`).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
