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

/// The text of a file as users' tools write it, JSON or YAML (accelerate writes its config as
/// YAML, and DeepSpeed configs are kept as either), read into a JSON value with each key once
/// at every depth. Text that opens as JSON is read as JSON only, so that its error is JSON's.
/// YAML is read within serde-saphyr's budgets (events, aliases, depth).
pub fn file_text(text: &str) -> Result<Value, String> {
    let opening = text.trim_start();
    if opening.starts_with(['{', '[']) {
        return serde_json::from_str::<Unique>(text)
            .map(|u| u.0)
            .map_err(|e| format!("JSON: {e}"));
    }
    serde_saphyr::from_str::<Unique>(text)
        .map(|u| u.0)
        .map_err(|e| format!("YAML: {}", first_line(&e.to_string())))
}

/// A parser's message up to its first line (serde-saphyr adds a drawing of the input).
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or("").trim();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// `deserialize_with` for a file's field: its object, or its text as a string (JSON or YAML,
/// [`file_text`]) holding one; `None` when absent or null.
pub fn file_object<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Map<String, Value>>, D::Error> {
    match Option::<Unique>::deserialize(deserializer)? {
        None | Some(Unique(Value::Null)) => Ok(None),
        Some(Unique(Value::Object(object))) => Ok(Some(object)),
        Some(Unique(Value::String(text))) => match file_text(&text) {
            Ok(Value::Object(object)) => Ok(Some(object)),
            Ok(_) => Err(de::Error::custom(
                "the file's text holds no mapping (a JSON object or YAML mapping)",
            )),
            Err(e) => Err(de::Error::custom(format_args!("the file's text: {e}"))),
        },
        Some(_) => Err(de::Error::invalid_type(
            de::Unexpected::Other("a value that is neither an object nor a file's text"),
            &"a JSON object, or a file's text (JSON or YAML)",
        )),
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
    fn a_files_text_is_read_as_json_or_yaml_with_each_key_once() {
        let yaml = "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_offload_params: false\n";
        let value = file_text(yaml).unwrap();
        assert_eq!(value["num_processes"], 8);
        assert_eq!(value["fsdp_config"]["fsdp_offload_params"], false);
        assert_eq!(value["fsdp_config"]["fsdp_sharding_strategy"], "FULL_SHARD");
        assert_eq!(file_text(r#"{"a": 1}"#).unwrap()["a"], 1);
        let repeated = file_text("a: 1\na: 2\n").unwrap_err();
        assert!(repeated.contains("duplicate"), "{repeated}");
        let json = file_text("{\"a\": ").unwrap_err();
        assert!(json.starts_with("JSON:"), "{json}");
        // Aliases that would expand without bound stop at the parser's budget.
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..20 {
            let prev = (b'a' + (i - 1) as u8) as char;
            let name = (b'a' + i as u8) as char;
            bomb.push_str(&format!(
                "{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        assert!(file_text(&bomb).is_err());
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
