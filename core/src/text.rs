//! Short text kept inline, for the request path: a shared-data key or a
//! response header value is written without allocating, and numbers without
//! the formatting machinery (both are costly per request in wasm).

/// Up to `N` bytes of text, inline. Only whole `&str`s and digits are
/// appended, so the contents are always valid UTF-8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineText<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> Default for InlineText<N> {
    fn default() -> Self {
        Self { bytes: [0; N], len: 0 }
    }
}

impl<const N: usize> InlineText<N> {
    /// Empties the text.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `text`, or returns false and appends nothing if it does not fit.
    pub fn push_str(&mut self, text: &str) -> bool {
        self.push_utf8(text.as_bytes())
    }

    /// Appends `bytes`, which must be valid UTF-8 (every caller passes a
    /// `str`'s bytes or ASCII), or returns false and appends nothing.
    fn push_utf8(&mut self, bytes: &[u8]) -> bool {
        let end = self.len + bytes.len();
        match self.bytes.get_mut(self.len..end) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.len = end;
                true
            }
            None => false,
        }
    }

    /// Appends the decimal digits of `n`, or returns false if they do not fit.
    pub fn push_u64(&mut self, mut n: u64) -> bool {
        /// "00" to "99": two digits a division.
        const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
            2021222324252627282930313233343536373839\
            4041424344454647484950515253545556575859\
            6061626364656667686970717273747576777879\
            8081828384858687888990919293949596979899";
        // Written where they go (their count known first), not into a
        // buffer and then copied: a copy of a length known only now is a
        // call to memcpy.
        let count = n.checked_ilog10().unwrap_or(0) as usize + 1;
        let end = self.len + count;
        let Some(room) = self.bytes.get_mut(self.len..end) else { return false };
        // The first digit of an odd count (or the zero of 0) alone, the
        // others in pairs from the last.
        let (first, pairs) = room.split_at_mut(count % 2);
        for room in pairs.rchunks_exact_mut(2) {
            let pair = (n % 100) as usize * 2;
            n /= 100;
            if let ([high, low], Some(&[a, b])) = (room, PAIRS.get(pair..pair + 2)) {
                *high = a;
                *low = b;
            }
        }
        if let Some(digit) = first.first_mut() {
            *digit = b'0' + n as u8;
        }
        // Digits are ASCII.
        self.len = end;
        true
    }

    /// The text from byte `start` to byte `end`.
    pub fn slice(&self, start: usize, end: usize) -> &str {
        std::str::from_utf8(self.slice_bytes(start, end)).unwrap_or("")
    }

    /// The bytes from `start` to `end`, for a caller that hands bytes on
    /// (a host call) and so need not have them checked as text again.
    pub fn slice_bytes(&self, start: usize, end: usize) -> &[u8] {
        self.bytes.get(start..end.min(self.len)).unwrap_or_default()
    }

    /// The whole text.
    pub fn as_str(&self) -> &str {
        self.slice(0, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn numbers_are_written_exactly() {
        let powers = (0..20).flat_map(|p| [10u64.pow(p) - 1, 10u64.pow(p), 10u64.pow(p) + 1]);
        for n in (0..=1000).chain(powers).chain([12345, 999_999_998, u64::MAX - 1, u64::MAX]) {
            let mut text = InlineText::<32>::default();
            assert!(text.push_u64(n));
            assert_eq!(text.as_str(), n.to_string());
        }
    }

    #[test]
    fn what_does_not_fit_is_refused_whole() {
        let mut text = InlineText::<8>::default();
        assert!(text.push_str("fg:ab:"));
        assert!(!text.push_u64(123), "three digits do not fit in two bytes");
        assert_eq!(text.as_str(), "fg:ab:");
        assert!(text.push_u64(12));
        assert_eq!(text.as_str(), "fg:ab:12");
        assert_eq!(text.slice(3, 5), "ab");
        text.clear();
        assert!(text.is_empty());
    }
}
