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
                    "{repo}: {file} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is \
                     set: download it once where the hub is reachable (`hf download {repo} \
                     {file}`), or give --config a config.json file or its directory",
                    self.cache_shown()
                ))
            };
        }
        match self.download(repo, file, optional) {
            // The adapter probe on a hub out of reach: the required file's error says so,
            // naming that file rather than the probe's.
            Err(Fetch::Unreachable(_)) if optional => Ok(None),
            Err(Fetch::Unreachable(why)) => Err(format!(
                "{repo}: {file} is not in the Hugging Face cache ({}) and the hub could not be \
                 reached ({why}): download it once where the hub is reachable (`hf download \
                 {repo} {file}`) and set HF_HUB_OFFLINE=1 to read the cache without asking, or \
                 give --config a config.json file or its directory",
                self.cache_shown()
            )),
            Err(Fetch::Refused(why)) => Err(why),
            Ok(value) => Ok(value),
        }
    }

    /// The cache folder looked in, as an error names it.
    fn cache_shown(&self) -> String {
        self.cache.as_ref().map_or_else(
            || "none: neither HF_HUB_CACHE, HF_HOME nor HOME is set".into(),
            |c| c.display().to_string(),
        )
    }

    /// The cached snapshot's `file` (`models--org--name/snapshots/<refs/main>/file`), only
    /// where it stays inside the cache: `refs/main` must name one snapshot folder (a commit
    /// id, not a path), and the file, its links followed (a snapshot's files link to
    /// `blobs/`), must resolve inside the cache root.
    fn cached(&self, repo: &str, file: &str) -> Option<PathBuf> {
        let root = self.cache.as_ref()?;
        let folder = root.join(format!("models--{}", repo.replace('/', "--")));
        let revision = read_capped(&folder.join("refs/main"), MAX_REF_BYTES).ok()?;
        let revision = std::str::from_utf8(&revision).ok()?.trim();
        if !is_revision(revision) {
            return None;
        }
        let path = folder.join("snapshots").join(revision).join(file);
        let resolved = path.canonicalize().ok()?;
        let root = root.canonicalize().ok()?;
        (resolved.starts_with(&root) && resolved.is_file()).then_some(resolved)
    }

    fn download(&self, repo: &str, file: &str, optional: bool) -> Result<Option<Value>, Fetch> {
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
        let mut response = request
            .call()
            .map_err(|e| Fetch::Unreachable(format!("{url}: {e}")))?;
        match response.status().as_u16() {
            200 => {}
            404 if optional => return Ok(None),
            401 | 403 => {
                return Err(Fetch::Refused(format!(
                    "{url}: {} (a gated or private repo: set HF_TOKEN)",
                    response.status()
                )))
            }
            _ => return Err(Fetch::Refused(format!("{url}: {}", response.status()))),
        }
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_FILE_BYTES)
            .read_to_vec()
            .map_err(|e| Fetch::Unreachable(format!("{url}: {e}")))?;
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| Fetch::Refused(format!("{url}: {e}")))
    }
}

/// Why a download gave no file: the hub out of reach (no network, a name that does not
/// resolve, a time-out), or its answer refused.
enum Fetch {
    Unreachable(String),
    Refused(String),
}

/// The most bytes of a `refs/main`: a commit id and a newline.
const MAX_REF_BYTES: u64 = 256;

/// Whether a `refs/main` names one snapshot folder: a commit id (or a tag-like name) of
/// letters, digits, `-`, `_` and `.`, never a path (`/`, `..`, an absolute one).
fn is_revision(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 128
        && text != "."
        && text != ".."
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The bytes of `path`, refused past `limit` before any is read (its size, then a read that
/// stops one byte past the limit, for a file that grows meanwhile or reports no size).
fn read_capped(path: &std::path::Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let too_large = || format!("{}: larger than {limit} bytes", path.display());
    let metadata = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !metadata.is_file() {
        return Err(format!("{}: not a file", path.display()));
    }
    if metadata.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// A cached file as JSON, within the cap a download has.
fn read_json(path: &std::path::Path) -> Result<Value, String> {
    let bytes = read_capped(path, MAX_FILE_BYTES)?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache root holding `models--org--m` with `refs/main` = `revision` and, under the
    /// snapshot, config.json linked to a blob (as huggingface_hub keeps them).
    fn cache_with(revision: &str) -> (tempfile::TempDir, Hub) {
        let root = tempfile::tempdir().unwrap();
        let folder = root.path().join("models--org--m");
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::create_dir_all(folder.join("blobs")).unwrap();
        std::fs::create_dir_all(folder.join("snapshots/abc123")).unwrap();
        std::fs::write(folder.join("refs/main"), revision).unwrap();
        std::fs::write(folder.join("blobs/b1"), r#"{"model_type": "gpt2"}"#).unwrap();
        std::os::unix::fs::symlink(
            "../../blobs/b1",
            folder.join("snapshots/abc123/config.json"),
        )
        .unwrap();
        let hub = Hub {
            cache: Some(root.path().to_path_buf()),
            endpoint: "http://127.0.0.1:9".into(),
            token: None,
            offline: true,
        };
        (root, hub)
    }

    #[test]
    fn the_cache_is_read_through_its_links_and_never_outside_its_root() {
        let (_root, hub) = cache_with("abc123\n");
        let config = hub.file("org/m", "config.json", false).unwrap().unwrap();
        assert_eq!(config["model_type"], "gpt2");
        // refs/main naming a path: absolute, or up and out.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("config.json"), "{}").unwrap();
        for revision in [outside.path().to_str().unwrap(), "../../..", "a/b"] {
            let (_root, hub) = cache_with(revision);
            assert!(hub.cached("org/m", "config.json").is_none(), "{revision}");
        }
        // A snapshot file linked out of the cache root.
        let (root, hub) = cache_with("abc123");
        let linked = root
            .path()
            .join("models--org--m/snapshots/abc123/adapter_config.json");
        std::os::unix::fs::symlink(outside.path().join("config.json"), linked).unwrap();
        assert!(hub.cached("org/m", "adapter_config.json").is_none());
    }

    #[test]
    fn a_file_past_the_cap_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        // Sparse: 3 GB of size, no bytes on disk; refused from its size alone.
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(3 << 30).unwrap();
        let refused = read_json(&path).unwrap_err();
        assert!(refused.contains("larger than"), "{refused}");
    }

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
