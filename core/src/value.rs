//! Descriptor values, of bounded size. A value is at most [`MAX_VALUE_BYTES`]
//! (the quota service's limit for one, so a global rule can always send it);
//! a longer one (a hostile header or query parameter, a huge claim) is
//! replaced by a stand-in of that size that still tells it apart: its first
//! bytes, `#`, and 16 hex digits of a hash of the whole value. Two values
//! share a bucket only if they are equal, or both long, alike in their first
//! [`KEPT_BYTES`] and equal in a 64-bit hash.
//!
//! The stand-in is built on the stack: reading a value never allocates more
//! than its bound.

use crate::hash::SipHasher;

/// The longest value a descriptor entry contributes, in bytes.
pub const MAX_VALUE_BYTES: usize = floodgate_protocol::MAX_ENTRY_LEN;

/// How much of a longer value its stand-in keeps (the rest of the stand-in
/// is `#` and 16 hex digits).
pub const KEPT_BYTES: usize = MAX_VALUE_BYTES - 17;

/// A value of at most [`MAX_VALUE_BYTES`], inline.
#[derive(Clone, Copy)]
pub struct BoundedValue {
    bytes: [u8; MAX_VALUE_BYTES],
    len: usize,
}

impl Default for BoundedValue {
    fn default() -> Self {
        Self { bytes: [0; MAX_VALUE_BYTES], len: 0 }
    }
}

impl std::fmt::Debug for BoundedValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_bytes()))
    }
}

impl BoundedValue {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// Collects `value`, or its stand-in if it is longer than
    /// [`MAX_VALUE_BYTES`] (the iterator is then walked once more, whole, to
    /// hash it).
    pub fn collect(value: impl Iterator<Item = u8> + Clone) -> Self {
        let mut out = Self::default();
        let mut rest = value.clone();
        for byte in rest.by_ref() {
            match out.bytes.get_mut(out.len) {
                Some(slot) => {
                    *slot = byte;
                    out.len += 1;
                }
                None => {
                    let mut hasher = SipHasher::new(0, 0);
                    for byte in value {
                        hasher.write(&[byte]);
                    }
                    out.len = KEPT_BYTES;
                    out.push_tag(hasher.finish());
                    break;
                }
            }
        }
        out
    }

    /// `value` itself when it is short enough, else its stand-in, built in
    /// `spare` (made then: a request's values are short, and making the
    /// room zeroes all of it).
    pub fn bound<'a>(value: &'a [u8], spare: &'a mut Option<BoundedValue>) -> &'a [u8] {
        if value.len() <= MAX_VALUE_BYTES {
            return value;
        }
        let spare = spare.get_or_insert_with(BoundedValue::default);
        spare.bytes[..KEPT_BYTES].copy_from_slice(&value[..KEPT_BYTES]);
        spare.len = KEPT_BYTES;
        spare.push_tag(hash(value));
        spare.as_bytes()
    }

    fn push_tag(&mut self, hash: u64) {
        let digits = b"0123456789abcdef";
        let tag = &mut self.bytes[self.len..self.len + 17];
        tag[0] = b'#';
        for (i, slot) in tag[1..].iter_mut().enumerate() {
            *slot = digits[((hash >> (60 - 4 * i)) & 0xf) as usize];
        }
        self.len += 17;
    }
}

/// `bytes` as text of at most [`MAX_VALUE_BYTES`]: invalid UTF-8 replaced by
/// U+FFFD, and, if that makes it longer than the bound, the stand-in (cut
/// at a character boundary, hashed over the bytes).
pub fn bounded_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() <= MAX_VALUE_BYTES {
        return text.into_owned();
    }
    let mut cut = KEPT_BYTES;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}#{:016x}", &text[..cut], hash(bytes))
}

/// The fixed-key hash a stand-in carries: the same in every Envoy, so a
/// global rule's long values name the same quota fleet-wide.
fn hash(bytes: &[u8]) -> u64 {
    let mut hasher = SipHasher::new(0, 0);
    hasher.write(bytes);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn short_values_are_themselves() {
        let mut spare = None;
        let value = vec![b'x'; MAX_VALUE_BYTES];
        assert_eq!(BoundedValue::bound(&value, &mut spare), &value[..]);
        assert!(spare.is_none(), "no room made for a value that fits");
        assert_eq!(BoundedValue::collect(value.iter().copied()).as_bytes(), &value[..]);
        assert_eq!(bounded_text(&value), "x".repeat(MAX_VALUE_BYTES));
    }

    #[test]
    fn long_values_get_a_distinct_stand_in_of_the_bound() {
        let a = [vec![b'x'; 300], b"a".to_vec()].concat();
        let b = [vec![b'x'; 300], b"b".to_vec()].concat();
        let (mut spare_a, mut spare_b) = (None, None);
        let bound_a = BoundedValue::bound(&a, &mut spare_a).to_vec();
        let bound_b = BoundedValue::bound(&b, &mut spare_b).to_vec();
        assert_eq!(bound_a.len(), MAX_VALUE_BYTES);
        assert_ne!(bound_a, bound_b);
        assert_eq!(&bound_a[..KEPT_BYTES], &a[..KEPT_BYTES]);
        assert_eq!(bound_a[KEPT_BYTES], b'#');
        // Collected from an iterator, or bounded from a slice: the same stand-in.
        assert_eq!(BoundedValue::collect(a.iter().copied()).as_bytes(), &bound_a[..]);
        // As text: the same, since it is valid UTF-8.
        assert_eq!(bounded_text(&a).as_bytes(), &bound_a[..]);
    }

    #[test]
    fn text_stays_within_the_bound_and_valid_utf8() {
        // 200 invalid bytes become 600 bytes of U+FFFD.
        let text = bounded_text(&[0xff; 200]);
        assert!(text.len() <= MAX_VALUE_BYTES, "{}", text.len());
        let text = bounded_text("é".repeat(200).as_bytes());
        assert!(text.len() <= MAX_VALUE_BYTES);
        assert!(text.ends_with(&format!("#{:016x}", hash("é".repeat(200).as_bytes()))));
    }
}
