//! SipHash-2-4, keyed: the hash that turns a request's descriptor into a
//! bucket identity.
//!
//! Keyed, so a client cannot pick values that land in another client's slot
//! group without knowing the per-VM secret; and written out here rather than
//! taken from `std`, whose `DefaultHasher` may change between Rust releases
//! while bucket identities live on in Envoy's shared data across upgrades.

/// Fewer than eight bytes as the low bytes of a little-endian word, the
/// rest zero (more than eight: zero).
pub fn partial_word(bytes: &[u8]) -> u64 {
    // Read as at most two overlapping loads (or three bytes), not copied
    // into a word: a copy of a length known only now is a call to memcpy,
    // dearer than the hashing of the word. Overlapping bytes are the same
    // byte at the same place, so or-ing them is harmless.
    let byte = |at: usize| u64::from(bytes.get(at).copied().unwrap_or(0));
    let word32 = |at: usize| match bytes.get(at..at + 4) {
        Some(&[a, b, c, d]) => u64::from(u32::from_le_bytes([a, b, c, d])),
        _ => 0,
    };
    match bytes.len() {
        8 => word32(0) | word32(4) << 32,
        0 | 9.. => 0,
        len @ 1..=3 => byte(0) | byte(len / 2) << (8 * (len / 2)) | byte(len - 1) << (8 * (len - 1)),
        len => word32(0) | word32(len - 4) << (8 * (len - 4)),
    }
}

/// A streaming SipHash-2-4 with a 128-bit key.
#[derive(Debug, Clone)]
pub struct SipHasher {
    v: [u64; 4],
    tail: u64,
    tail_len: usize,
    length: u64,
}

impl SipHasher {
    /// A hasher keyed with `(k0, k1)`.
    pub fn new(k0: u64, k1: u64) -> Self {
        Self {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            tail: 0,
            tail_len: 0,
            length: 0,
        }
    }

    fn round(&mut self) {
        let [v0, v1, v2, v3] = &mut self.v;
        *v0 = v0.wrapping_add(*v1);
        *v1 = v1.rotate_left(13) ^ *v0;
        *v0 = v0.rotate_left(32);
        *v2 = v2.wrapping_add(*v3);
        *v3 = v3.rotate_left(16) ^ *v2;
        *v0 = v0.wrapping_add(*v3);
        *v3 = v3.rotate_left(21) ^ *v0;
        *v2 = v2.wrapping_add(*v1);
        *v1 = v1.rotate_left(17) ^ *v2;
        *v2 = v2.rotate_left(32);
    }

    fn compress(&mut self, word: u64) {
        self.v[3] ^= word;
        self.round();
        self.round();
        self.v[0] ^= word;
    }

    /// Feeds bytes.
    pub fn write(&mut self, bytes: &[u8]) {
        self.length = self.length.wrapping_add(bytes.len() as u64);
        let mut rest = bytes;
        // A word begun by an earlier write is completed first.
        if self.tail_len > 0 {
            let (head, after) = rest.split_at(rest.len().min(8 - self.tail_len));
            // `tail_len` is 1 to 7 here, and `head` fits in what is left.
            self.tail |= partial_word(head) << (8 * self.tail_len);
            self.tail_len += head.len();
            rest = after;
            if self.tail_len < 8 {
                return;
            }
            let word = self.tail;
            self.compress(word);
            self.tail = 0;
            self.tail_len = 0;
        }
        let mut words = rest.chunks_exact(8);
        for word in &mut words {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(word);
            self.compress(u64::from_le_bytes(raw));
        }
        // No word is begun here: the tail is empty.
        let remainder = words.remainder();
        self.tail = partial_word(remainder);
        self.tail_len = remainder.len();
    }

    /// Feeds a field: its length (8 bytes, little-endian), then its bytes,
    /// so that fields written one after another stay apart. The length
    /// goes in as one word, whatever part of a word is already begun.
    pub fn write_field(&mut self, bytes: &[u8]) {
        let length = bytes.len() as u64;
        self.length = self.length.wrapping_add(8);
        if self.tail_len == 0 {
            self.compress(length);
        } else {
            // The word begun is completed by the length's low bytes; its
            // high bytes begin the next word, as long as the first was.
            let shift = 8 * self.tail_len as u32;
            let word = self.tail | (length << shift);
            self.compress(word);
            self.tail = length >> (64 - shift);
        }
        self.write(bytes);
    }

    /// The 64-bit hash of everything written.
    pub fn finish(mut self) -> u64 {
        let last = self.tail | ((self.length & 0xff) << 56);
        self.compress(last);
        self.v[2] ^= 0xff;
        for _ in 0..4 {
            self.round();
        }
        self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3]
    }
}

#[cfg(test)]
mod tests {
    /// Every length up to a word reads as its bytes copied into a zeroed
    /// word; longer reads as zero.
    #[test]
    fn partial_words_are_the_bytes_zero_padded() {
        let bytes = [0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99];
        for len in 0..=bytes.len() {
            let mut raw = [0u8; 8];
            if len <= 8 {
                raw[..len].copy_from_slice(&bytes[..len]);
            }
            assert_eq!(partial_word(&bytes[..len]), u64::from_le_bytes(raw), "{len} bytes");
        }
    }

    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The reference key 00 01 .. 0f of the SipHash paper's test vectors.
    fn reference() -> SipHasher {
        SipHasher::new(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908)
    }

    #[test]
    fn matches_the_reference_vectors() {
        // vectors.h of the reference implementation: inputs 00, 00 01, ...
        let expected: [(usize, u64); 4] = [
            (0, 0x726f_db47_dd0e_0e31),
            (1, 0x74f8_39c5_93dc_67fd),
            (8, 0x93f5_f579_9a93_2462),
            (15, 0xa129_ca61_49be_45e5),
        ];
        for (len, want) in expected {
            let input: Vec<u8> = (0..len as u8).collect();
            let mut hasher = reference();
            hasher.write(&input);
            assert_eq!(hasher.finish(), want, "input of length {len}");
        }
    }

    #[test]
    fn streaming_in_pieces_equals_one_write() {
        let input: Vec<u8> = (0..40u8).collect();
        let mut whole = reference();
        whole.write(&input);
        let whole = whole.finish();
        for size in 1..=17 {
            let mut pieces = reference();
            for chunk in input.chunks(size) {
                pieces.write(chunk);
            }
            assert_eq!(whole, pieces.finish(), "pieces of {size} bytes");
        }
    }

    /// A field is its length's eight bytes and its own, whatever part of a
    /// word earlier writes began.
    #[test]
    fn a_field_is_its_length_then_its_bytes_at_every_offset() {
        let field: Vec<u8> = (100..113u8).collect();
        for begun in 0..=17 {
            let before: Vec<u8> = (0..begun as u8).collect();
            let mut as_field = reference();
            as_field.write(&before);
            as_field.write_field(&field);
            let mut as_bytes = reference();
            as_bytes.write(&before);
            as_bytes.write(&(field.len() as u64).to_le_bytes());
            as_bytes.write(&field);
            assert_eq!(as_field.finish(), as_bytes.finish(), "{begun} bytes before the field");
        }
    }

    #[test]
    fn fields_are_delimited() {
        let hash = |fields: &[&[u8]]| {
            let mut hasher = SipHasher::new(1, 2);
            fields.iter().for_each(|f| hasher.write_field(f));
            hasher.finish()
        };
        assert_ne!(hash(&[b"ab", b"c"]), hash(&[b"a", b"bc"]));
    }
}
