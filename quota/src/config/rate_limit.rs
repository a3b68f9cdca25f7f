//! A descriptor's `rate_limit`: envoyproxy/ratelimit's fields, `algorithm`,
//! and the algorithm's own fields, refused while their key is read when
//! unknown, then built into a [`Limit`] by the core.

use std::fmt;

use floodgate_core::bounds::MAX_AMOUNT;
use floodgate_core::time::{Nanos, SECOND};
use serde::Deserialize;

use super::limit::{algorithm_fields, offered, Limit, DEFAULT_ALGORITHM};
use super::tree::DescriptorRule;

/// A `rate_limit` as written: envoyproxy/ratelimit's fields, `algorithm`,
/// and the algorithm's own fields, which the core validates (so this parser
/// knows no algorithm's fields by name: any offered algorithm's is taken).
#[derive(Default)]
pub(super) struct RawRateLimit {
    unit: Option<Unit>,
    requests_per_unit: Option<u64>,
    unlimited: bool,
    algorithm: Option<AlgorithmName>,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl<'de> Deserialize<'de> for RawRateLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(RateLimitVisitor)
    }
}

struct RateLimitVisitor;

/// A field of a `rate_limit`; an unknown one is refused while its key is
/// read, so that the error points at the key.
enum Field {
    Unit,
    RequestsPerUnit,
    Unlimited,
    Algorithm,
    /// Accepted for compatibility with envoyproxy/ratelimit; unused.
    Name,
    /// One of an offered algorithm's own fields.
    Own(String),
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FieldVisitor)
    }
}

struct FieldVisitor;

impl serde::de::Visitor<'_> for FieldVisitor {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Field, E> {
        Ok(match name {
            "unit" => Field::Unit,
            "requests_per_unit" => Field::RequestsPerUnit,
            "unlimited" => Field::Unlimited,
            "algorithm" => Field::Algorithm,
            "name" => Field::Name,
            _ if algorithm_fields().contains(&name) => Field::Own(name.to_string()),
            _ => {
                return Err(E::custom(format!(
                    "unknown field `{name}`, expected unit, requests_per_unit, unlimited, name, algorithm or an \
                     algorithm's field ({})",
                    algorithm_fields().join(", ")
                )))
            }
        })
    }
}

/// Sets a field read once; a repeated field is an error.
fn once<T, E: serde::de::Error>(slot: &mut Option<T>, field: &str, value: T) -> Result<(), E> {
    if slot.replace(value).is_some() {
        return Err(E::custom(format!("duplicate field `{field}`")));
    }
    Ok(())
}

impl<'de> serde::de::Visitor<'de> for RateLimitVisitor {
    type Value = RawRateLimit;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a rate_limit (a mapping with unit and requests_per_unit, or unlimited)")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<RawRateLimit, A::Error> {
        let mut raw = RawRateLimit::default();
        let mut unlimited = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Unit => once(&mut raw.unit, "unit", map.next_value()?)?,
                Field::RequestsPerUnit => once(&mut raw.requests_per_unit, "requests_per_unit", map.next_value()?)?,
                Field::Unlimited => once(&mut unlimited, "unlimited", map.next_value()?)?,
                Field::Algorithm => once(&mut raw.algorithm, "algorithm", map.next_value()?)?,
                Field::Name => {
                    let _: Option<String> = map.next_value()?;
                }
                Field::Own(name) => {
                    let value: serde_json::Value = map.next_value()?;
                    if raw.fields.insert(name.clone(), value).is_some() {
                        return Err(serde::de::Error::custom(format!("duplicate field `{name}`")));
                    }
                }
            }
        }
        raw.unlimited = unlimited.unwrap_or(false);
        Ok(raw)
    }
}

impl RawRateLimit {
    /// The rule of descriptor `key`, its limit built and checked by the core.
    pub(super) fn into_rule(self, key: &str, shadow: bool) -> Result<DescriptorRule, String> {
        if self.unlimited {
            if self.unit.is_some()
                || self.requests_per_unit.is_some()
                || self.algorithm.is_some()
                || !self.fields.is_empty()
            {
                return Err(format!(
                    "descriptor {key:?}: rate_limit with unlimited: true must not set unit, requests_per_unit, algorithm or {}",
                    algorithm_fields().join(", ")
                ));
            }
            return Ok(DescriptorRule::Unlimited);
        }
        let (Some(unit), Some(limit)) = (self.unit, self.requests_per_unit) else {
            return Err(format!(
                "descriptor {key:?}: rate_limit needs both unit and requests_per_unit (or unlimited: true)"
            ));
        };
        if limit == 0 || limit > MAX_AMOUNT {
            return Err(format!(
                "descriptor {key:?}: requests_per_unit must be between 1 and {MAX_AMOUNT}, not {limit}"
            ));
        }
        let algorithm = self.algorithm.map_or(DEFAULT_ALGORITHM, |a| a.0);
        let fields = serde_json::Value::Object(self.fields).to_string();
        let limit = Limit::new(algorithm, limit, unit.0, &fields).map_err(|e| format!("descriptor {key:?}: {e}"))?;
        Ok(DescriptorRule::Limited { limit, shadow })
    }
}

/// A `unit`, case-insensitive as envoyproxy/ratelimit reads it.
struct Unit(Nanos);

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let seconds: u64 = match text.to_ascii_lowercase().as_str() {
            "second" => 1,
            "minute" => 60,
            "hour" => 3_600,
            "day" => 86_400,
            "week" => 7 * 86_400,
            // envoyproxy/ratelimit's fixed lengths for these calendar units.
            "month" => 30 * 86_400,
            "year" => 365 * 86_400,
            _ => {
                return Err(serde::de::Error::custom(format!(
                    "unknown unit {text:?}: use second, minute, hour, day, week, month or year"
                )))
            }
        };
        Ok(Unit(SECOND.times(seconds)))
    }
}

/// An offered algorithm's registry name; others are refused here, where the
/// error points at the value.
struct AlgorithmName(&'static str);

impl<'de> Deserialize<'de> for AlgorithmName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        offered(&text).map(|r| AlgorithmName(r.name)).map_err(serde::de::Error::custom)
    }
}
