//! A model's files from the Hugging Face hub, for `gpucast estimate --config org/name`: from
//! the local cache the `huggingface_hub` library keeps (`HF_HUB_CACHE`, else `HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`), else from the hub's `resolve` route (`HF_ENDPOINT`, else
//! huggingface.co; `HF_TOKEN` for gated and private repos), never the network when
//! `HF_HUB_OFFLINE` is set. The CLI's only; the service reads no files and calls no one.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

/// The most bytes read of one file: configs are kilobytes.
const MAX_FILE_BYTES: u64 = 4 << 20;

/// How long one download may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// What a repo gives a job: its model's config.json, and for an adapter repo (one holding
/// adapter_config.json) the adapter config, the config being its base model's.
#[derive(Debug)]
pub struct HubModel {
    pub config: Value,
    pub adapter_config: Option<Value>,
}

/// Whether `text` names a hub repo (`org/name`, or `name`) rather than a file: letters,
/// digits, `-`, `_` and `.` in one or two parts, not `.` or `..`.
pub fn is_repo_id(text: &str) -> bool {
    let parts: Vec<&str> = text.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 96
                && *p != "."
                && *p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// `repo`'s model: its adapter_config.json and its base's config.json when it is an adapter
/// repo, else its config.json.
pub fn model(repo: &str) -> Result<HubModel, String> {
    let hub = Hub::from_env();
    if let Some(adapter) = hub.file(repo, "adapter_config.json", true)? {
        let base = adapter
            .get("base_model_name_or_path")
            .and_then(Value::as_str)
            .filter(|b| is_repo_id(b))
            .ok_or_else(|| {
                format!("{repo}: adapter_config.json names no hub base_model_name_or_path")
            })?
            .to_owned();
        let config = hub
            .file(&base, "config.json", false)?
            .ok_or_else(|| format!("{base}: no config.json"))?;
        return Ok(HubModel {
            config,
            adapter_config: Some(adapter),
        });
    }
    let config = hub
        .file(repo, "config.json", false)?
        .ok_or_else(|| format!("{repo}: no config.json"))?;
    Ok(HubModel {
        config,
        adapter_config: None,
    })
}

/// Where files are looked for, read from the environment as `huggingface_hub` reads it.
struct Hub {
    cache: Option<PathBuf>,
    endpoint: String,
    token: Option<String>,
    offline: bool,
}

impl Hub {
    fn from_env() -> Hub {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let cache = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| var("HF_HOME").map(|home| PathBuf::from(home).join("hub")))
            .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache/huggingface/hub")));
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        Hub {
            cache,
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_owned(),
            token: var("HF_TOKEN"),
            offline,
        }
    }

    /// `file` of `repo` as JSON: from the cache, else downloaded. `None` when the repo has no
    /// such file and `optional` (a 404, or absent from a cached snapshot that has config.json).
    fn file(&self, repo: &str, file: &str, optional: bool) -> Result<Option<Value>, String> {
        if let Some(cached) = self.cached(repo, file) {
            return read_json(&cached).map(Some);
        }
        if optional && self.cached(repo, "config.json").is_some() {
            return Ok(None);
        }
        if self.offline {
            return if optional {
                Ok(None)
            } else {
                Err(format!(
                    "{repo}: {file} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set",
                    self.cache
                        .as_ref()
                        .map_or("none".into(), |c| c.display().to_string())
                ))
            };
        }
        self.download(repo, file, optional)
    }

    /// The cached snapshot's `file` (`models--org--name/snapshots/<refs/main>/file`).
    fn cached(&self, repo: &str, file: &str) -> Option<PathBuf> {
        let folder = self
            .cache
            .as_ref()?
            .join(format!("models--{}", repo.replace('/', "--")));
        let revision = std::fs::read_to_string(folder.join("refs/main")).ok()?;
        let path = folder.join("snapshots").join(revision.trim()).join(file);
        path.is_file().then_some(path)
    }

    fn download(&self, repo: &str, file: &str, optional: bool) -> Result<Option<Value>, String> {
        let url = format!("{}/{repo}/resolve/main/{file}", self.endpoint);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(TIMEOUT))
            .http_status_as_error(false)
            .build()
            .into();
        let mut request = agent.get(&url);
        if let Some(token) = &self.token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        let mut response = request.call().map_err(|e| format!("{url}: {e}"))?;
        match response.status().as_u16() {
            200 => {}
            404 if optional => return Ok(None),
            401 | 403 => {
                return Err(format!(
                    "{url}: {} (a gated or private repo: set HF_TOKEN)",
                    response.status()
                ))
            }
            _ => return Err(format!("{url}: {}", response.status())),
        }
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_FILE_BYTES)
            .read_to_vec()
            .map_err(|e| format!("{url}: {e}"))?;
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| format!("{url}: {e}"))
    }
}

fn read_json(path: &std::path::Path) -> Result<Value, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "{}: larger than {MAX_FILE_BYTES} bytes",
            path.display()
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_told_from_paths() {
        for id in [
            "meta-llama/Llama-3.2-1B",
            "gpt2",
            "Qwen/Qwen2.5-7B-Instruct",
        ] {
            assert!(is_repo_id(id), "{id}");
        }
        for path in ["config.json/x/y", "./config", "../x", "a b/c", "", "/abs"] {
            assert!(!is_repo_id(path), "{path}");
        }
    }
}
