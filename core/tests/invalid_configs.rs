//! Every file in `fixtures/invalid/` is a configuration that must be refused,
//! beside a `.error` file holding (a prefix of) the message it must produce.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::path::Path;

use floodgate_core::config::Config;

#[test]
fn each_invalid_fixture_is_refused_with_its_message() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid");
    let mut checked = 0;
    let mut paths: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    for path in paths.iter().filter(|p| p.extension().is_some_and(|e| e == "json")) {
        let json = fs::read(path).unwrap();
        let expected = fs::read_to_string(path.with_extension("error")).unwrap();
        let expected = expected.trim_end();
        let err = Config::parse(&json).expect_err(&format!("{} was accepted", path.display()));
        let message = format!("{}: {}", err.field, err.message);
        assert!(message.starts_with(expected), "{}:\n  got      {message}\n  expected {expected}", path.display());
        assert!(err.to_string().starts_with("invalid floodgate config: "));
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} fixtures found in {}", dir.display());
}
