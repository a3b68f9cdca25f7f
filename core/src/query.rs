//! Query parameters, read from `:path` the way Envoy's `query_parameters` and
//! `query_parameter_value_match` rate-limit actions read them (measured on
//! Envoy 1.40; see `docs/envoy-attributes.md`):
//!
//! - the query is what follows the first `?`, split at `&`, each piece at its
//!   first `=` (a piece without one is the name, with an empty value);
//! - names and values are percent-decoded: `%` and two hex digits become that
//!   byte, anything else stays as written (`%zz`, a trailing `%`); `+` stays;
//! - names compare exactly after decoding, and the first occurrence of a name
//!   wins, even when its value is empty.
//!
//! Nothing here allocates: a value is decoded into the caller's buffer, and
//! a value longer than the buffer is cut to it.

/// The still-encoded value of the first parameter whose decoded name is
/// `name` in the query of `path`, or `None` when there is none.
pub fn first_value<'a>(path: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let start = path.iter().position(|&b| b == b'?')? + 1;
    path[start..].split(|&b| b == b'&').find_map(|piece| {
        let (raw_name, value) = match piece.iter().position(|&b| b == b'=') {
            Some(at) => (&piece[..at], &piece[at + 1..]),
            None => (piece, &piece[piece.len()..]),
        };
        decodes_to(raw_name, name).then_some(value)
    })
}

/// Percent-decodes `raw` into `out` and returns the decoded length: at most
/// `out.len()`, the rest of a longer value being cut.
pub fn decode_into(raw: &[u8], out: &mut [u8]) -> usize {
    let mut len = 0;
    for byte in Decoded::new(raw) {
        let Some(slot) = out.get_mut(len) else { break };
        *slot = byte;
        len += 1;
    }
    len
}

/// Whether `raw` percent-decodes to exactly `want`.
fn decodes_to(raw: &[u8], want: &[u8]) -> bool {
    let mut decoded = Decoded::new(raw);
    want.iter().all(|&b| decoded.next() == Some(b)) && decoded.next().is_none()
}

/// The bytes of a percent-encoded text, decoded one by one.
#[derive(Debug, Clone)]
pub struct Decoded<'a> {
    rest: &'a [u8],
}

impl<'a> Decoded<'a> {
    /// Decodes `raw`.
    pub fn new(raw: &'a [u8]) -> Self {
        Self { rest: raw }
    }
}

impl Iterator for Decoded<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let (&first, rest) = self.rest.split_first()?;
        if let [b'%', hi, lo, tail @ ..] = self.rest {
            if let (Some(hi), Some(lo)) = (hex_digit(*hi), hex_digit(*lo)) {
                self.rest = tail;
                return Some((hi << 4) | lo);
            }
        }
        self.rest = rest;
        Some(first)
    }
}

fn hex_digit(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The decoded first value of `name` in `path`, as a string.
    fn value(path: &str, name: &str) -> Option<Vec<u8>> {
        let raw = first_value(path.as_bytes(), name.as_bytes())?;
        let mut out = [0u8; 64];
        let len = decode_into(raw, &mut out);
        Some(out[..len].to_vec())
    }

    #[test]
    fn what_envoy_1_40_produced_for_each_query() {
        // Each row was measured through Envoy's own `query_parameters` action.
        let rows: &[(&str, Option<&[u8]>)] = &[
            ("/q?user=bob", Some(b"bob")),
            ("/q", None),
            ("/q?", None),
            ("/q?other=1", None),
            ("/q?user=a%20b", Some(b"a b")),
            ("/q?user=a+b", Some(b"a+b")),
            ("/q?user=a%zz", Some(b"a%zz")),
            ("/q?user=%", Some(b"%")),
            ("/q?user=", Some(b"")),
            ("/q?user", Some(b"")),
            ("/q?user=%C3%A9", Some("é".as_bytes())),
            ("/q?user=x=y", Some(b"x=y")),
            ("/q?user=x%3Dy", Some(b"x=y")),
            ("/q?user=first&user=second", Some(b"first")),
            ("/q?user=&user=z", Some(b"")),
            ("/q?user&user=z", Some(b"")),
            ("/q?us%65r=bob", Some(b"bob")),
            ("/q?user=%41", Some(b"A")),
            ("/q?user=%2541", Some(b"%41")),
            ("/q?user=ab%", Some(b"ab%")),
            ("/q?USER=bob", None),
            ("/q?&user=bob", Some(b"bob")),
            ("/q?user=bob&&user=x", Some(b"bob")),
            ("/q?=x&user=bob", Some(b"bob")),
            ("/q??user=bob", None),
            ("/q?x=1?user=bob", None),
        ];
        for (path, want) in rows {
            assert_eq!(value(path, "user").as_deref(), *want, "{path}");
        }
    }

    #[test]
    fn malformed_escapes_stay_as_written() {
        assert_eq!(value("/?k=%4", "k").unwrap(), b"%4");
        assert_eq!(value("/?k=%zz%41", "k").unwrap(), b"%zzA");
        assert_eq!(value("/?k=%%41", "k").unwrap(), b"%A");
        assert_eq!(value("/?k=%00%ff", "k").unwrap(), b"\x00\xff", "any byte, even NUL or not UTF-8");
        assert_eq!(value("/?%6B=1", "k").unwrap(), b"1", "an escaped name");
        assert_eq!(value("/?k%=1", "k"), None);
    }

    #[test]
    fn a_long_value_is_cut_to_the_buffer() {
        let path = format!("/?k={}", "%41".repeat(1000));
        let raw = first_value(path.as_bytes(), b"k").unwrap();
        let mut out = [0u8; 256];
        assert_eq!(decode_into(raw, &mut out), 256);
        assert!(out.iter().all(|&b| b == b'A'));
    }

    #[test]
    fn hostile_paths_never_panic() {
        // Each path and name gives what the rules say, whatever its bytes: no
        // `?`, no query; an empty name is an empty piece's, or one's before its
        // `=`; bytes that are neither an escape nor UTF-8 stay as written.
        // Every pair not listed has no value.
        let found: &[(&[u8], &[u8], &[u8])] = &[
            (b"?", b"", b""),
            (b"?=", b"", b""),
            (b"?&&&", b"", b""),
            (b"?a=%\xff%", b"a", b"%\xff%"),
            (b"\xff?\xff=\xff", b"\xff", b"\xff"),
        ];
        let mut out = [0u8; 8];
        for path in [&b""[..], b"?", b"%", b"?%", b"?%4", b"?=", b"?&&&", b"?a=%\xff%", b"\xff?\xff=\xff"] {
            for name in [&b""[..], b"a", b"\xff"] {
                let got = first_value(path, name).map(|raw| {
                    let len = decode_into(raw, &mut out);
                    out[..len].to_vec()
                });
                let want = found.iter().find(|(p, n, _)| *p == path && *n == name).map(|(_, _, value)| value.to_vec());
                assert_eq!(got, want, "{:?} in {:?}", String::from_utf8_lossy(name), String::from_utf8_lossy(path));
            }
        }
    }
}
