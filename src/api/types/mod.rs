//! Wire types: what clients send and receive. Kept apart from the domain types so the API can
//! stay stable while the internals change; field names here are a contract with schedulers.
//!
//! - [`request`]: a training job to estimate, with its GPU, setup and model.
//! - [`response`]: the estimate: memory, bound, fit, breakdown, utilization, the setup read.
//! - [`calibration`]: observations, profiles, the watch and the host's devices.
//! - [`plan`]: the reverse question: the largest micro-batch, sequence, setup and card that fit.
//! - [`service`]: batches, problems, the loaded estimators, health, the GPU catalogue.
//! - here: how numbers and objects are read where serde's derive is laxer than the schema.

mod calibration;
mod gpu_request;
mod plan;
mod request;
mod response;
mod service;

pub use calibration::*;
pub use gpu_request::*;
pub use plan::*;
pub use request::*;
pub use response::*;
pub use service::*;

/// Structs read from JSON objects only: serde's derive also reads a struct from an array of
/// its fields in order (`"trainable": [null, null]` was accepted), which the schema of an
/// object does not allow (found by schemathesis's negative_data_rejection).
pub(super) mod object_only {
    use std::marker::PhantomData;

    use serde::de::{MapAccess, Visitor};
    use serde::{Deserialize, Deserializer};

    struct Object<T>(T);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct Only<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for Only<T> {
                type Value = T;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                    T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                }
            }
            deserializer.deserialize_map(Only(PhantomData)).map(Object)
        }
    }

    pub fn one<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<T, D::Error> {
        Object::deserialize(deserializer).map(|Object(value)| value)
    }

    pub fn optional<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<Option<T>, D::Error> {
        Option::<Object<T>>::deserialize(deserializer)
            .map(|object| object.map(|Object(value)| value))
    }
}

/// Non-negative whole numbers, also when a client's JSON writes them as `29440.0` (JSON Schema's
/// `integer` admits that; serde's `u64` alone would not).
pub(super) mod whole_number {
    use serde::de::{Deserializer, Error, Unexpected, Visitor};
    use serde::Deserialize;

    struct WholeNumber;

    /// Integral floats are exact up to 2^53; beyond that a float cannot name one integer.
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0;

    impl Visitor<'_> for WholeNumber {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a non-negative whole number")
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
            if v.fract() == 0.0 && (0.0..=MAX_EXACT).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(Unexpected::Float(v), &self))
            }
        }
    }

    #[derive(Deserialize)]
    struct Whole(#[serde(deserialize_with = "one")] u64);

    pub fn one<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(WholeNumber)
    }

    pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Ok(Option::<Whole>::deserialize(d)?.map(|w| w.0))
    }

    pub fn optional_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
        Ok(Option::<Vec<Whole>>::deserialize(d)?.map(|v| v.into_iter().map(|w| w.0).collect()))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[derive(Deserialize)]
        struct Probe {
            #[serde(deserialize_with = "one")]
            n: u64,
        }

        fn parse(json: &str) -> Result<u64, String> {
            serde_json::from_str::<Probe>(json)
                .map(|p| p.n)
                .map_err(|e| e.to_string())
        }

        #[test]
        fn whole_numbers_are_accepted_in_either_notation_and_nothing_else() {
            assert_eq!(parse(r#"{"n": 29440}"#), Ok(29440));
            assert_eq!(parse(r#"{"n": 29440.0}"#), Ok(29440));
            assert!(parse(r#"{"n": 8.5}"#).is_err());
            assert!(parse(r#"{"n": -8}"#).is_err());
            assert!(parse(r#"{"n": 1e300}"#).is_err());
            assert!(parse(r#"{"n": "8"}"#)
                .unwrap_err()
                .contains("non-negative whole number"));
        }
    }
}
