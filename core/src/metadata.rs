//! Envoy metadata, read from the bytes the host gives: a serialized
//! `envoy.config.core.v3.Metadata` (the request's dynamic metadata, or the
//! matched route's). A value is found by namespace and path, the way Envoy's
//! `metadata` rate-limit action finds it, and is borrowed from those bytes:
//! nothing is copied or allocated, and bytes that are not a well-formed
//! message read as absent.
//!
//! Envoy's host hands a single value without its type (a string and a number
//! can come back as the same bytes; see `docs/envoy-attributes.md`), so the
//! whole message is read and walked here, where every value keeps its type.
//!
//! The wire format, as far as it is needed: `Metadata.filter_metadata`
//! (field number 1) is a map from namespace to `google.protobuf.Struct`,
//! each entry a message with the key in field 1 and the value in field 2;
//! `Struct.fields` (field 1) maps names to `google.protobuf.Value` the same
//! way; a `Value` is one of `null_value` (1), `number_value` (2, a
//! little-endian double), `string_value` (3), `bool_value` (4),
//! `struct_value` (5), `list_value` (6). As protobuf defines it, the last
//! entry of a repeated key and the last member of a `oneof` win.

/// Where a `metadata` entry or condition reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetadataSource {
    /// The request's dynamic metadata: what earlier filters wrote (e.g.
    /// `jwt_authn`'s verified payload, `header_to_metadata`).
    Dynamic,
    /// The matched route's `metadata`.
    RouteEntry,
}

/// A value's place in metadata: Envoy's `MetadataKey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataKey {
    /// The filter namespace, e.g. `envoy.filters.http.jwt_authn`.
    pub namespace: String,
    /// The field names from the namespace's struct down to the value.
    pub path: Vec<String>,
}

/// What a [`MetadataKey`] leads to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Found<'a> {
    /// Nothing: no such namespace or field, a path through a non-struct, or
    /// bytes that are not a well-formed message.
    Absent,
    /// `null`.
    Null,
    /// A number (every JSON number is a double in a `Struct`).
    Number(f64),
    /// A string's bytes (may be empty).
    String(&'a [u8]),
    /// A boolean.
    Bool(bool),
    /// A struct (an object).
    Struct,
    /// A list.
    List,
}

impl<'a> Found<'a> {
    /// The value as Envoy's `metadata` action takes it: a non-empty string.
    /// Anything else (a number, a boolean, a struct, an empty string) counts
    /// as absent, as in Envoy.
    pub fn non_empty_string(self) -> Option<&'a [u8]> {
        match self {
            Found::String(bytes) if !bytes.is_empty() => Some(bytes),
            _ => None,
        }
    }
}

/// The kinds of value a reader of metadata can use: a host that must ask
/// for each kind of value separately (the native build: Envoy answers a
/// string, a number or a boolean at a key, and logs an error for a value of
/// another kind than the one asked) asks only for these, the commonest
/// first. Whatever it leaves unasked the reader treats as absent anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// Only a string: a `metadata` descriptor entry, a `string_match`.
    String,
    /// Only a boolean: a `bool_match`.
    Bool,
    /// A string, a number or a boolean: a `present_match`.
    Scalar,
}

/// Finds `key` in the serialized `metadata`.
pub fn lookup<'a>(metadata: &'a [u8], key: &MetadataKey) -> Found<'a> {
    let Some(mut fields) = map_value(metadata, key.namespace.as_bytes()) else { return Found::Absent };
    let Some((last, within)) = key.path.split_last() else { return Found::Struct };
    for name in within {
        let Some(value) = map_value(fields, name.as_bytes()) else { return Found::Absent };
        match decode_value(value) {
            Some(Kind::Struct(inner)) => fields = inner,
            _ => return Found::Absent,
        }
    }
    match map_value(fields, last.as_bytes()).and_then(decode_value) {
        None => Found::Absent,
        Some(Kind::Null) => Found::Null,
        Some(Kind::Number(n)) => Found::Number(n),
        Some(Kind::String(s)) => Found::String(s),
        Some(Kind::Bool(b)) => Found::Bool(b),
        Some(Kind::Struct(_)) => Found::Struct,
        Some(Kind::List) => Found::List,
    }
}

/// A `Value`'s kind, with a struct's bytes kept for walking on.
enum Kind<'a> {
    Null,
    Number(f64),
    String(&'a [u8]),
    Bool(bool),
    Struct(&'a [u8]),
    List,
}

/// The value bytes of the last entry named `name` in the map that is field
/// 1 of `message` (both `Metadata.filter_metadata` and `Struct.fields`), or
/// `None` if there is none or the bytes are malformed.
fn map_value<'a>(message: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let mut found = None;
    for field in Fields(message) {
        let Field::Bytes(1, entry) = field.ok()? else { continue };
        let mut key: &[u8] = &[];
        let mut value: &[u8] = &[];
        for part in Fields(entry) {
            match part.ok()? {
                Field::Bytes(1, bytes) => key = bytes,
                Field::Bytes(2, bytes) => value = bytes,
                _ => {}
            }
        }
        if key == name {
            found = Some(value);
        }
    }
    found
}

/// Decodes a `google.protobuf.Value`; `None` when no kind is set or the
/// bytes are malformed.
fn decode_value(value: &[u8]) -> Option<Kind<'_>> {
    let mut kind = None;
    for field in Fields(value) {
        kind = match field.ok()? {
            Field::Varint(1, _) => Some(Kind::Null),
            Field::Fixed64(2, bits) => Some(Kind::Number(f64::from_bits(bits))),
            Field::Bytes(3, bytes) => Some(Kind::String(bytes)),
            Field::Varint(4, flag) => Some(Kind::Bool(flag != 0)),
            Field::Bytes(5, bytes) => Some(Kind::Struct(bytes)),
            Field::Bytes(6, _) => Some(Kind::List),
            _ => kind,
        };
    }
    kind
}

/// One field of a protobuf message: its number and its value.
enum Field<'a> {
    Varint(u64, u64),
    Fixed64(u64, u64),
    Bytes(u64, &'a [u8]),
    Fixed32,
}

/// The fields of a message in order; an `Err` item (then nothing more) for
/// malformed bytes.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.read_field();
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

/// Bytes that are not a well-formed protobuf message.
#[derive(Debug)]
struct Malformed;

impl<'a> Fields<'a> {
    fn read_field(&mut self) -> Result<Field<'a>, Malformed> {
        let tag = self.varint()?;
        let number = tag >> 3;
        Ok(match tag & 7 {
            0 => Field::Varint(number, self.varint()?),
            1 => Field::Fixed64(number, u64::from_le_bytes(self.take_array()?)),
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| Malformed)?;
                Field::Bytes(number, self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Field::Fixed32
            }
            // Groups (3, 4) are not used by these messages; 6 and 7 do not exist.
            _ => return Err(Malformed),
        })
    }

    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut value = 0u64;
        for (i, &byte) in self.0.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                self.0 = &self.0[i + 1..];
                return Ok(value);
            }
        }
        Err(Malformed)
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], Malformed> {
        if len > self.0.len() {
            return Err(Malformed);
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head)
    }

    fn take_array(&mut self) -> Result<[u8; 8], Malformed> {
        self.take(8)?.try_into().map_err(|_| Malformed)
    }
}

/// Serialized metadata built from values, as Envoy would send it: for
/// tests and fuzzing.
pub mod build {
    /// A `google.protobuf.Value`.
    #[derive(Debug, Clone, PartialEq)]
    pub enum ProtoValue {
        /// `null`.
        Null,
        /// A number.
        Number(f64),
        /// A string (any bytes).
        String(Vec<u8>),
        /// A boolean.
        Bool(bool),
        /// A struct: named values, in order (a repeated name is kept: the
        /// last one wins when read).
        Struct(Fields),
        /// A list.
        List(Vec<ProtoValue>),
    }

    /// A struct's fields: names and values, in order.
    pub type Fields = Vec<(Vec<u8>, ProtoValue)>;

    /// A serialized `Metadata` with these namespaces and their structs.
    pub fn metadata(namespaces: &[(&[u8], Fields)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, fields) in namespaces {
            let mut entry = Vec::new();
            bytes_field(&mut entry, 1, name);
            bytes_field(&mut entry, 2, &structure(fields));
            bytes_field(&mut out, 1, &entry);
        }
        out
    }

    fn structure(fields: &[(Vec<u8>, ProtoValue)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in fields {
            let mut entry = Vec::new();
            bytes_field(&mut entry, 1, name);
            bytes_field(&mut entry, 2, &encode(value));
            bytes_field(&mut out, 1, &entry);
        }
        out
    }

    fn encode(value: &ProtoValue) -> Vec<u8> {
        let mut out = Vec::new();
        match value {
            ProtoValue::Null => varint_field(&mut out, 1, 0),
            ProtoValue::Number(n) => {
                varint(&mut out, (2 << 3) | 1);
                out.extend_from_slice(&n.to_bits().to_le_bytes());
            }
            ProtoValue::String(s) => bytes_field(&mut out, 3, s),
            ProtoValue::Bool(b) => varint_field(&mut out, 4, u64::from(*b)),
            ProtoValue::Struct(fields) => bytes_field(&mut out, 5, &structure(fields)),
            ProtoValue::List(items) => {
                let mut list = Vec::new();
                for item in items {
                    bytes_field(&mut list, 1, &encode(item));
                }
                bytes_field(&mut out, 6, &list);
            }
        }
        out
    }

    fn varint_field(out: &mut Vec<u8>, number: u64, value: u64) {
        varint(out, number << 3);
        varint(out, value);
    }

    fn bytes_field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
        varint(out, (number << 3) | 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::build::{metadata, ProtoValue as Value};
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Dynamic metadata as Envoy 1.40 served it to a wasm filter (the
    /// `metadata` property), after `header_to_metadata` (namespace `hdr`:
    /// `tenant: "acme"`, `num: 17` as a NUMBER) and `jwt_authn` with
    /// `payload_in_metadata: jwt_payload` verified a token whose payload was
    /// `{"iss": "https://issuer.test", "exp": 1795535974, "sub": "alice",
    /// "n": 42, "big": 12345678901, "f": 1.5, "neg": -3, "admin": true,
    /// "no": false, "groups": ["a", "b"], "tenant": {"id": "t1", "tier":
    /// "gold", "n": 7}, "empty": "", "nul": null, "uni": "héllo"}`.
    const ENVOY_DYNAMIC: &str = "0a2b0a0368647212240a100a036e756d12091100000000000031400a100a0674656e616e7412061a0461636d650acd020a1c656e766f792e66696c746572732e687474702e6a77745f617574686e12ac020aa9020a0b6a77745f7061796c6f61641299022a96020a080a026e6f120220000a160a0667726f757073120c320a0a031a01610a031a01620a0e0a0373756212071a05616c6963650a0f0a03756e6912081a0668c3a96c6c6f0a0e0a0166120911000000000000f83f0a0b0a05656d70747912021a000a100a03657870120911000080196dc1da410a0b0a0561646d696e120220010a380a0674656e616e74122e2a2c0a0e0a016e1209110000000000001c400a0e0a047469657212061a04676f6c640a0a0a02696412041a0274310a100a036269671209110000a8e1e0fe06420a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a0e0a016e12091100000000000045400a090a036e756c120208000a100a036e656712091100000000000008c0";

    /// Route metadata as Envoy 1.40 served it (`xds.route_metadata`) for a
    /// route with `metadata: {filter_metadata: {floodgate: {tier: gold, n: 5}}}`.
    const ENVOY_ROUTE: &str =
        "0a2d0a09666c6f6f646761746512200a0e0a047469657212061a04676f6c640a0e0a016e1209110000000000001440";

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
    }

    fn key(namespace: &str, path: &[&str]) -> MetadataKey {
        MetadataKey { namespace: namespace.into(), path: path.iter().map(|s| s.to_string()).collect() }
    }

    fn jwt(path: &[&str]) -> MetadataKey {
        let mut full = vec!["jwt_payload"];
        full.extend_from_slice(path);
        key("envoy.filters.http.jwt_authn", &full)
    }

    #[test]
    fn reads_what_envoy_serves() {
        let dynamic = hex(ENVOY_DYNAMIC);
        assert_eq!(lookup(&dynamic, &jwt(&["sub"])), Found::String(b"alice"));
        assert_eq!(lookup(&dynamic, &jwt(&["tenant", "id"])), Found::String(b"t1"));
        assert_eq!(lookup(&dynamic, &jwt(&["tenant", "n"])), Found::Number(7.0));
        assert_eq!(lookup(&dynamic, &jwt(&["n"])), Found::Number(42.0));
        assert_eq!(lookup(&dynamic, &jwt(&["big"])), Found::Number(12_345_678_901.0));
        assert_eq!(lookup(&dynamic, &jwt(&["neg"])), Found::Number(-3.0));
        assert_eq!(lookup(&dynamic, &jwt(&["admin"])), Found::Bool(true));
        assert_eq!(lookup(&dynamic, &jwt(&["no"])), Found::Bool(false));
        assert_eq!(lookup(&dynamic, &jwt(&["groups"])), Found::List);
        assert_eq!(lookup(&dynamic, &jwt(&["tenant"])), Found::Struct);
        assert_eq!(lookup(&dynamic, &jwt(&["nul"])), Found::Null);
        assert_eq!(lookup(&dynamic, &jwt(&["empty"])), Found::String(b""));
        assert_eq!(lookup(&dynamic, &jwt(&["uni"])), Found::String("héllo".as_bytes()));
        assert_eq!(lookup(&dynamic, &key("hdr", &["tenant"])), Found::String(b"acme"));
        assert_eq!(lookup(&dynamic, &key("hdr", &["num"])), Found::Number(17.0));
        let route = hex(ENVOY_ROUTE);
        assert_eq!(lookup(&route, &key("floodgate", &["tier"])), Found::String(b"gold"));
        assert_eq!(lookup(&route, &key("floodgate", &["n"])), Found::Number(5.0));
    }

    #[test]
    fn missing_keys_and_paths_through_non_structs_are_absent() {
        let dynamic = hex(ENVOY_DYNAMIC);
        assert_eq!(lookup(&dynamic, &jwt(&["missing"])), Found::Absent);
        assert_eq!(lookup(&dynamic, &jwt(&["sub", "x"])), Found::Absent);
        assert_eq!(lookup(&dynamic, &jwt(&["groups", "0"])), Found::Absent);
        assert_eq!(lookup(&dynamic, &key("nope", &["x"])), Found::Absent);
        assert_eq!(lookup(&dynamic, &key("envoy.filters.http.jwt_authn", &["JWT_PAYLOAD", "sub"])), Found::Absent);
        assert_eq!(lookup(&[], &jwt(&["sub"])), Found::Absent);
    }

    #[test]
    fn only_non_empty_strings_are_values_as_in_envoy() {
        let dynamic = hex(ENVOY_DYNAMIC);
        let value = |path: &[&str]| lookup(&dynamic, &jwt(path)).non_empty_string();
        assert_eq!(value(&["sub"]), Some(&b"alice"[..]));
        for not_a_string in [&["n"][..], &["admin"], &["tenant"], &["groups"], &["nul"], &["empty"], &["missing"]] {
            assert_eq!(value(not_a_string), None, "{not_a_string:?}");
        }
    }

    #[test]
    fn the_last_of_a_repeated_name_wins() {
        let blob = metadata(&[
            (b"ns", vec![(b"k".to_vec(), Value::String(b"first".to_vec()))]),
            (b"ns", vec![(b"k".to_vec(), Value::String(b"a".to_vec())), (b"k".to_vec(), Value::Bool(true))]),
        ]);
        assert_eq!(lookup(&blob, &key("ns", &["k"])), Found::Bool(true));
    }

    #[test]
    fn the_builder_writes_what_envoy_writes() {
        let built = metadata(&[(
            b"floodgate",
            vec![(b"tier".to_vec(), Value::String(b"gold".to_vec())), (b"n".to_vec(), Value::Number(5.0))],
        )]);
        assert_eq!(built, hex(ENVOY_ROUTE));
    }

    #[test]
    fn malformed_bytes_are_absent_never_a_panic() {
        let dynamic = hex(ENVOY_DYNAMIC);
        let probes = [jwt(&["sub"]), jwt(&["tenant", "id"]), key("hdr", &["num"])];
        // Every truncation and every single-byte change of a real message.
        for end in 0..dynamic.len() {
            for probe in &probes {
                let _ = lookup(&dynamic[..end], probe);
            }
        }
        for at in 0..dynamic.len() {
            for byte in [0x00, 0x07, 0x0b, 0x7f, 0x80, 0xff] {
                let mut bent = dynamic.clone();
                bent[at] = byte;
                for probe in &probes {
                    let _ = lookup(&bent, probe);
                }
            }
        }
        assert_eq!(
            lookup(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], &jwt(&["sub"])),
            Found::Absent
        );
        assert_eq!(lookup(&[0x0b], &jwt(&["sub"])), Found::Absent, "a group start");
    }
}
