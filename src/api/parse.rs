//! Untrusted JSON into the wire types: syntax errors are malformed (400), type and value errors
//! invalid (422), both naming the JSON path. Shared by the HTTP extractors and the CLI.

use serde::de::DeserializeOwned;

use crate::api::types::EstimateRequest;
use crate::api::unique_keys::Unique;
use crate::error::ApiError;

/// Parses an estimate request. A body that is not one but holds a Hugging Face config's keys
/// at the top (`model_type` or `architectures`, no `transformer_config`, `layers` or
/// `summary`) is read as the request whose `transformer_config` is those keys, the request's
/// own fields (`batch_size`, `seq_len`, `precision`, `gpu`, ...) staying beside them: the
/// config file as downloaded, plus the setup. Tried only after the plain parse failed, so a
/// request costs nothing more.
pub fn parse_estimate(bytes: &[u8], prefix: &str) -> Result<EstimateRequest, ApiError> {
    let refused = match parse_json::<EstimateRequest>(bytes, prefix) {
        Err(refused @ ApiError::InvalidInput(_)) => refused,
        Err(ApiError::MalformedJson(_)) if looks_like_printout(bytes) => {
            return Err(ApiError::PrintoutBody)
        }
        other => return other,
    };
    match hub_config_request(bytes)? {
        Some(wrapped) => parse_json(&wrapped, prefix),
        None => Err(refused),
    }
}

/// Whether a body that is not JSON is a model printout pasted as it is: it does not open
/// like JSON, and holds a printout's marks (torchsummary's and torchinfo's header, Keras's
/// `Layer (type)`, a module print's `Name(` first line).
pub fn looks_like_printout(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]);
    let opening = text.trim_start();
    if opening.starts_with(['{', '[', '"']) {
        return false;
    }
    let first = opening.lines().next().unwrap_or("").trim_end();
    let module_print = first.ends_with('(')
        && first[..first.len() - 1]
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    module_print
        || ["Layer (type", "Param #", "Output Shape", "Total params"]
            .iter()
            .any(|mark| text.contains(mark))
}

/// The body with a hub config's keys moved under `transformer_config`; `None` when it is not
/// shaped like one; a 422 for a config whose keys repeat (at any depth).
fn hub_config_request(bytes: &[u8]) -> Result<Option<Vec<u8>>, ApiError> {
    let Ok(serde_json::Value::Object(top)) = serde_json::from_slice(bytes) else {
        return Ok(None);
    };
    let is_config = top.contains_key("model_type") || top.contains_key("architectures");
    let is_request = ["transformer_config", "layers", "summary"]
        .iter()
        .any(|k| top.contains_key(*k));
    if !is_config || is_request {
        return Ok(None);
    }
    // Read again with each key once (serde_json kept the last of two): a repeated key, at any
    // depth, is a 422 naming it.
    if let Err(e) = serde_json::from_slice::<Unique>(bytes) {
        return Err(ApiError::InvalidInput(format!("body: {e}")));
    }
    let fields = request_fields();
    let (mut request, config): (serde_json::Map<_, _>, serde_json::Map<_, _>) = top
        .into_iter()
        .partition(|(key, _)| fields.iter().any(|f| f == key));
    // A misspelt setup field would be read as a config key and ignored: `precison: bf16`
    // answered as fp32, 27 GB for 13. Config keys this near a field are refused instead.
    for key in config.keys() {
        if let Some(field) = near_field(key, fields) {
            return Err(ApiError::InvalidInput(format!(
                "{}: not a request field, and a config.json has no such key; did you mean \
                 `{field}`? (the setup beside a config's keys is read by the request's field \
                 names)",
                crate::job::echo(key)
            )));
        }
    }
    request.insert(
        "transformer_config".into(),
        serde_json::Value::Object(config),
    );
    Ok(serde_json::to_vec(&request).ok())
}

/// The request field `key` misspells: within an edit distance of one per five characters
/// (at least one), not equal. Config keys are long and unlike the request's fields; none of
/// the committed configs' keys comes this near one.
fn near_field<'f>(key: &str, fields: &'f [String]) -> Option<&'f str> {
    let reach = (key.len() / 5).max(1);
    fields
        .iter()
        .filter(|f| f.as_str() != key)
        .map(|f| (strsim::levenshtein(f, key), f.as_str()))
        .filter(|(distance, _)| *distance <= reach)
        .min()
        .map(|(_, field)| field)
}

/// The field names of an estimate request, read from its schema (the one list there is).
fn request_fields() -> &'static [String] {
    static FIELDS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    FIELDS.get_or_init(|| {
        use utoipa::openapi::schema::Schema;
        use utoipa::openapi::RefOr;
        match <EstimateRequest as utoipa::PartialSchema>::schema() {
            RefOr::T(Schema::Object(object)) => object.properties.keys().cloned().collect(),
            _ => Vec::new(),
        }
    })
}

/// Parses JSON; syntax errors are malformed (400), type and value errors invalid (422), both
/// naming the JSON path (prefixed with `prefix`) where they occurred.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8], prefix: &str) -> Result<T, ApiError> {
    // serde also reads structs from JSON arrays (by position); requests must be objects.
    if let Some(&first) = bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        if first != b'{' && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
            return Err(ApiError::InvalidInput(format!(
                "{}: expected a JSON object",
                field_name(prefix)
            )));
        }
    }
    deserialize(bytes, prefix)
}

pub(crate) fn deserialize<T: DeserializeOwned>(bytes: &[u8], prefix: &str) -> Result<T, ApiError> {
    // Tracking the path costs a third of a large body's parse: a body that parses needs none,
    // and one that fails is read again below to say where.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value: T =
        serde_path_to_error::deserialize(&mut deserializer).map_err(|e| classify(&e, prefix))?;
    deserializer.end().map_err(|e| {
        if prefix.is_empty() && several_documents(bytes) {
            ApiError::MalformedJson(SEVERAL_DOCUMENTS.to_string())
        } else {
            ApiError::MalformedJson(format!("{e}"))
        }
    })?;
    Ok(value)
}

const SEVERAL_DOCUMENTS: &str = "the body holds several JSON documents (JSON Lines, such as \
     describe's output for several batch sizes); send one job per request to /v1/estimate, or \
     all of them as {\"items\": [...]} to /v1/estimate/batch (describe --batch-body writes that body)";

/// Whether the body is a sequence of JSON documents rather than one: the error path only.
fn several_documents(bytes: &[u8]) -> bool {
    let mut documents =
        serde_json::Deserializer::from_slice(bytes).into_iter::<serde::de::IgnoredAny>();
    let mut count = 0usize;
    for document in documents.by_ref() {
        if document.is_err() {
            return false;
        }
        count += 1;
    }
    count > 1
}

/// Deserializes an already parsed JSON value (a batch item).
pub fn from_value<T: DeserializeOwned>(
    value: serde_json::Value,
    prefix: &str,
) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::InvalidInput(format!(
            "{}: expected a JSON object",
            field_name(prefix)
        )));
    }
    // As for a body: the path is tracked only to say where an item that fails went wrong.
    if let Ok(parsed) = T::deserialize(&value) {
        return Ok(parsed);
    }
    serde_path_to_error::deserialize(value).map_err(|e| classify(&e, prefix))
}

fn field_name(prefix: &str) -> &str {
    if prefix.is_empty() {
        "body"
    } else {
        prefix
    }
}

fn classify(error: &serde_path_to_error::Error<serde_json::Error>, prefix: &str) -> ApiError {
    let path = error.path().to_string();
    let field = match (prefix.is_empty(), path.as_str()) {
        (true, ".") => "body".to_string(),
        (true, _) => path,
        (false, ".") => prefix.to_string(),
        (false, _) => format!("{prefix}.{path}"),
    };
    let inner = error.inner();
    // serde_json appends " at line L column C"; the path says more.
    let message = inner.to_string();
    let message = message
        .split(" at line ")
        .next()
        .unwrap_or(&message)
        .to_string();
    match inner.classify() {
        serde_json::error::Category::Data => ApiError::InvalidInput(format!("{field}: {message}")),
        _ => ApiError::MalformedJson(format!("malformed JSON: {inner}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key given twice is refused, naming it, in a request's config and in a bare config,
    /// however deep; serde_json alone would keep the last.
    #[test]
    fn a_repeated_key_is_refused_in_a_config_and_a_bare_config() {
        let refused = |body: &str| match parse_estimate(body.as_bytes(), "") {
            Err(ApiError::InvalidInput(detail)) => detail,
            other => panic!("{body}: {other:?}"),
        };
        let wrapped = r#"{"batch_size": 1, "seq_len": 8, "transformer_config":
            {"model_type": "llama", "hidden_size": 4096, "hidden_size": 64}}"#;
        assert!(refused(wrapped).contains("duplicate key `hidden_size`"));
        let bare = r#"{"model_type": "llama", "rope_scaling": {"factor": 8, "factor": 2},
            "batch_size": 1, "seq_len": 8}"#;
        assert!(refused(bare).contains("duplicate key `factor`"));
        let files = r#"{"batch_size": 1, "layers": [], "training_arguments":
            {"optim": "adamw_torch", "optim": "sgd"}}"#;
        assert!(refused(files).contains("duplicate key `optim`"));
    }

    #[test]
    fn a_pasted_printout_is_told_how_to_wrap_it() {
        for text in [
            "Net(\n  (fc): Linear(in_features=3, out_features=4, bias=True)\n)",
            "----\n        Layer (type)               Output Shape         Param #\n====",
        ] {
            assert!(matches!(
                parse_estimate(text.as_bytes(), ""),
                Err(ApiError::PrintoutBody)
            ));
        }
        assert!(matches!(
            parse_estimate(b"{\"batch_size\": ", ""),
            Err(ApiError::MalformedJson(_))
        ));
    }

    /// A setup field misspelt beside a bare config is refused with the field it misses, not
    /// read as a config key; every committed config's own keys still pass.
    #[test]
    fn a_misspelt_field_beside_a_bare_config_is_refused() {
        let body = r#"{"model_type": "llama", "hidden_size": 64, "precison": "bf16",
            "batch_size": 1, "seq_len": 8}"#;
        match parse_estimate(body.as_bytes(), "") {
            Err(ApiError::InvalidInput(detail)) => {
                assert!(detail.contains("did you mean `precision`"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/transformer_configs"
        );
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            match std::fs::read_dir(entry.path()) {
                Ok(inner) => paths.extend(inner.flatten().map(|e| e.path())),
                Err(_) => paths.push(entry.path()),
            }
        }
        let mut read = 0;
        for path in paths {
            let Ok(serde_json::Value::Object(config)) =
                serde_json::from_slice(&std::fs::read(&path).unwrap())
            else {
                continue;
            };
            for key in config.keys() {
                assert_eq!(near_field(key, request_fields()), None, "{key} in {path:?}");
            }
            read += 1;
        }
        assert!(read > 20, "{read} configs");
    }
}
