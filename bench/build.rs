//! Finds the Redis servers of the crate's test harness, which the bench reuses:
//! `tests/support/server.rs` once the support module is split into files,
//! `tests/support/mod.rs` before (drop that case when the split has landed).

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(split_support)");
    println!("cargo::rerun-if-changed=../tests/support");
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    if Path::new(&manifest)
        .join("../tests/support/server.rs")
        .exists()
    {
        println!("cargo::rustc-cfg=split_support");
    }
}
