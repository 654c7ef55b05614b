//! JSON objects read with every key once, at every depth. serde_json keeps the last of two
//! equal keys without a word, so `{"hidden_size": 4096, "hidden_size": 64}` inside a config
//! would be answered for a model the caller may not have meant; a caller's files are read here
//! instead, and a repeated key is a 422 naming it.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A JSON value whose objects, however deep, hold each key once.
pub struct Unique(pub Value);

impl<'de> Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Unique, D::Error> {
        deserializer.deserialize_any(UniqueVisitor).map(Unique)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Unique::deserialize(deserializer).map(|u| u.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(Unique(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "duplicate key `{}`",
                    crate::job::echo(&key)
                )));
            }
            let Unique(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// `deserialize_with` for an optional object field: `None` when absent or null, an error for
/// a repeated key at any depth or for a value that is not an object.
pub fn object<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Map<String, Value>>, D::Error> {
    match Option::<Unique>::deserialize(deserializer)? {
        None | Some(Unique(Value::Null)) => Ok(None),
        Some(Unique(Value::Object(object))) => Ok(Some(object)),
        Some(_) => Err(de::Error::invalid_type(
            de::Unexpected::Other("a non-object value"),
            &"a JSON object",
        )),
    }
}

/// `deserialize_with` for an optional value of any type: `None` when absent or null, an
/// error for a repeated key at any depth.
pub fn optional_value<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Value>, D::Error> {
    match Option::<Unique>::deserialize(deserializer)? {
        None | Some(Unique(Value::Null)) => Ok(None),
        Some(Unique(value)) => Ok(Some(value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Holder {
        #[serde(default, deserialize_with = "object")]
        config: Option<Map<String, Value>>,
    }

    fn read(json: &str) -> Result<Option<Map<String, Value>>, String> {
        serde_json::from_str::<Holder>(json)
            .map(|h| h.config)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_key_repeated_at_any_depth_is_refused_and_named() {
        let top = read(r#"{"config": {"hidden_size": 4096, "hidden_size": 64}}"#).unwrap_err();
        assert!(top.contains("duplicate key `hidden_size`"), "{top}");
        let deep = read(r#"{"config": {"text_config": {"a": [{"b": 1, "b": 2}]}}}"#).unwrap_err();
        assert!(deep.contains("duplicate key `b`"), "{deep}");
    }

    #[test]
    fn objects_read_as_serde_json_reads_them_otherwise() {
        let text = r#"{"a": 1, "b": -2, "c": 2.5, "d": "x", "e": null, "f": [true, {"g": {}}]}"#;
        let plain: Map<String, Value> = serde_json::from_str(text).unwrap();
        let config = read(&format!(r#"{{"config": {text}}}"#)).unwrap().unwrap();
        assert_eq!(config, plain);
        assert_eq!(read(r#"{"config": null}"#).unwrap(), None);
        assert_eq!(read("{}").unwrap(), None);
        assert!(read(r#"{"config": [1]}"#).is_err());
    }
}
