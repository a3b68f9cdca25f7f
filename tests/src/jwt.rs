//! JWTs for Envoy's `jwt_authn`: an issuer with an RSA key of its own (made
//! by the `openssl` command, no network), its JWKS, the tokens it signs,
//! and the filter that trusts it.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::ports::scratch_dir;

/// Issues RS256 tokens for Envoy's `jwt_authn`, as an identity provider
/// would: a fresh 2048-bit RSA key made by the `openssl` command (no
/// network), its JWKS, and tokens it signs.
pub struct Issuer {
    key: PathBuf,
    modulus: Vec<u8>,
}

impl Issuer {
    /// The `iss` of every token.
    pub const ISS: &'static str = "https://issuer.test";

    /// A new issuer with a key of its own.
    pub fn generate() -> Issuer {
        let key = scratch_dir().join("key.pem");
        let made = Command::new("openssl")
            .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"])
            .arg(&key)
            .output()
            .expect("the openssl command must be on PATH");
        assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
        let out = Command::new("openssl").args(["rsa", "-noout", "-modulus", "-in"]).arg(&key).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let hex = text.trim().strip_prefix("Modulus=").expect("openssl printed the modulus");
        let modulus = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        Issuer { key, modulus }
    }

    /// The JWKS with this issuer's public key (one line of JSON).
    pub fn jwks(&self) -> String {
        serde_json::json!({"keys": [{"kty": "RSA", "alg": "RS256", "use": "sig", "kid": "test",
            "n": base64url(&self.modulus), "e": "AQAB"}]})
        .to_string()
    }

    /// A token with these claims, plus `iss` and an `exp` an hour ahead
    /// unless the claims set them.
    pub fn token(&self, claims: serde_json::Value) -> String {
        let mut claims = claims;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let object = claims.as_object_mut().expect("claims are a JSON object");
        object.entry("iss").or_insert(Self::ISS.into());
        object.entry("exp").or_insert((now + 3600).into());
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": "test"});
        let input =
            format!("{}.{}", base64url(header.to_string().as_bytes()), base64url(claims.to_string().as_bytes()));
        let mut signer = Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(&self.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        signer.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let signed = signer.wait_with_output().unwrap();
        assert!(signed.status.success());
        format!("{input}.{}", base64url(&signed.stdout))
    }

    /// Envoy's `jwt_authn` filter trusting this issuer, requiring a valid
    /// token for paths under `prefix`, with the verified payload in dynamic
    /// metadata (`envoy.filters.http.jwt_authn`, key `jwt_payload`): for
    /// [`crate::setup::Setup::filters_before`].
    pub fn jwt_authn_filter(&self, prefix: &str) -> serde_json::Value {
        serde_json::json!({
            "name": "envoy.filters.http.jwt_authn",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
                "providers": {
                    "test": {
                        "issuer": Self::ISS,
                        "local_jwks": {"inline_string": self.jwks()},
                        "payload_in_metadata": "jwt_payload",
                    },
                },
                "rules": [{"match": {"prefix": prefix}, "requires": {"provider_name": "test"}}],
            },
        })
    }
}

/// Base64url without padding (RFC 7515).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let word = chunk.iter().enumerate().fold(0u32, |w, (i, &b)| w | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((word >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::base64url;

    #[test]
    fn base64url_is_rfc_7515s() {
        assert_eq!(base64url(b""), "");
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"fo"), "Zm8");
        assert_eq!(base64url(b"foo"), "Zm9v");
        assert_eq!(base64url(b"foob"), "Zm9vYg");
        assert_eq!(base64url(&[0xfb, 0xff, 0xbf]), "-_-_");
    }
}
