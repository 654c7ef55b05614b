//! Idempotency keys for `POST /v1/calibration/observations`: a retry of a recorded call returns
//! the original answer instead of recording the observations twice.
//!
//! A call can be recorded and still be answered 503 (the guard's timeout fires while the
//! recording, which is not cancelled, finishes), or its answer can be lost on the way back; a
//! client that retries would then count its observations twice. With an `Idempotency-Key`
//! header, the first call with a key records and remembers its answer; a call with the same
//! key and the same body gets that answer back (waiting for it while the first still runs); the
//! same key with another body is refused. Keys are remembered for [`KEY_TTL`], at most
//! [`MAX_KEYS`] of them and [`MAX_ANSWER_BYTES`] of their answers (the oldest are forgotten
//! first), and only in this process.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::error::ApiError;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// The response header set on an answer replayed for a key.
pub const REPLAYED_HEADER: &str = "idempotency-replayed";
/// How long a key's answer is remembered.
pub const KEY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How many keys are remembered at most.
pub const MAX_KEYS: usize = 10_000;
/// How many bytes of answers are remembered at most: an answer for 1,000 observations is a few
/// MiB, and a caller with fresh keys must not grow the process without bound.
pub const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;
/// The longest key accepted.
const MAX_KEY_LEN: usize = 255;

/// Where a call with a key stands.
#[derive(Debug, Clone)]
pub enum Progress {
    Running,
    /// Recorded; the answer's JSON body, serialised.
    Done(axum::body::Bytes),
}

#[derive(Debug)]
struct Entry {
    id: u64,
    fingerprint: [u8; 32],
    created: Instant,
    progress: watch::Receiver<Progress>,
    /// The answer's bytes once recorded.
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Keys by age, oldest first (with their entry's id: a key forgotten and reused appears twice).
    order: VecDeque<(String, u64)>,
    next_id: u64,
    /// The bytes of every remembered answer.
    bytes: usize,
}

/// The keys seen recently and what became of their calls.
#[derive(Debug)]
pub struct IdempotencyKeys {
    inner: Mutex<Inner>,
    ttl: Duration,
    capacity: usize,
    max_bytes: usize,
}

/// What to do with a call that carries a key.
pub enum Claim {
    /// First call with this key: record, then [`Ticket::succeed`].
    Fresh(Ticket),
    /// Recorded already: answer this body (JSON) again.
    Replay(axum::body::Bytes),
    /// The first call with this key is still running: wait for it, then claim again.
    Wait(watch::Receiver<Progress>),
}

/// The right to record a call under a key. Dropped without [`Ticket::succeed`] (the call
/// failed, so nothing was recorded), the key is forgotten and may be used again.
pub struct Ticket {
    keys: Arc<IdempotencyKeys>,
    key: String,
    id: u64,
    progress: watch::Sender<Progress>,
    done: bool,
}

impl Ticket {
    /// The call was recorded and answered with `body` (JSON). The oldest answers are
    /// forgotten while the remembered ones pass the byte limit.
    pub fn succeed(mut self, body: axum::body::Bytes) {
        self.done = true;
        let size = body.len();
        let _ = self.progress.send(Progress::Done(body));
        let mut inner = self.keys.lock();
        if let Some(entry) = inner.entries.get_mut(&self.key).filter(|e| e.id == self.id) {
            entry.bytes = size;
            inner.bytes += size;
        }
        while inner.bytes > self.keys.max_bytes {
            let Some((oldest, id)) = inner.order.pop_front() else {
                break;
            };
            if inner.entries.get(&oldest).is_some_and(|e| e.id == id) {
                inner.forget(&oldest);
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            let mut inner = self.keys.lock();
            if inner
                .entries
                .get(&self.key)
                .is_some_and(|e| e.id == self.id)
            {
                inner.forget(&self.key);
            }
            // Waiters see the sender go and claim again.
        }
    }
}

impl Inner {
    fn forget(&mut self, key: &str) {
        if let Some(entry) = self.entries.remove(key) {
            self.bytes -= entry.bytes;
        }
    }
}

impl IdempotencyKeys {
    pub fn new(ttl: Duration, capacity: usize, max_bytes: usize) -> IdempotencyKeys {
        IdempotencyKeys {
            inner: Mutex::new(Inner::default()),
            ttl,
            capacity,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims `key` for a call whose body hashes to `fingerprint`. The same key with another
    /// body is refused (422).
    pub fn claim(self: &Arc<Self>, key: &str, fingerprint: [u8; 32]) -> Result<Claim, ApiError> {
        let mut inner = self.lock();
        let now = Instant::now();
        // Forget the expired keys and, beyond the capacity, the oldest.
        while let Some((oldest, id)) = inner.order.front().cloned() {
            let created = inner
                .entries
                .get(&oldest)
                .filter(|e| e.id == id)
                .map(|e| e.created);
            let live = created.is_some_and(|c| now.duration_since(c) < self.ttl);
            if live && inner.entries.len() < self.capacity {
                break;
            }
            inner.order.pop_front();
            if created.is_some() {
                inner.forget(&oldest);
            }
        }
        if let Some(entry) = inner.entries.get(key) {
            if entry.fingerprint != fingerprint {
                return Err(ApiError::InvalidInput(format!(
                    "{HEADER}: `{key}` was used with a different body; use a new key for new observations"
                )));
            }
            return Ok(match &*entry.progress.borrow() {
                Progress::Done(body) => Claim::Replay(body.clone()),
                Progress::Running => Claim::Wait(entry.progress.clone()),
            });
        }
        let (sender, receiver) = watch::channel(Progress::Running);
        inner.next_id += 1;
        let id = inner.next_id;
        inner.entries.insert(
            key.to_string(),
            Entry {
                id,
                fingerprint,
                created: now,
                progress: receiver,
                bytes: 0,
            },
        );
        inner.order.push_back((key.to_string(), id));
        Ok(Claim::Fresh(Ticket {
            keys: Arc::clone(self),
            key: key.to_string(),
            id,
            progress: sender,
            done: false,
        }))
    }
}

/// Waits until the first call with a key has finished (recorded, or failed and forgotten).
pub async fn settled(mut progress: watch::Receiver<Progress>) {
    // An error means the ticket was dropped: the call failed and the key is free again.
    let _ = progress.wait_for(|p| matches!(p, Progress::Done(_))).await;
}

/// The call's key, if it has one: 1 to 255 visible ASCII characters.
pub fn key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(HEADER) else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .filter(|k| (1..=MAX_KEY_LEN).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::InvalidInput(format!(
                "{HEADER}: must be 1 to {MAX_KEY_LEN} visible ASCII characters"
            ))
        })?;
    Ok(Some(key.to_string()))
}

/// A digest of the body as sent: a retry sends the same bytes (a client that reformats its
/// body between tries gets a 422 naming the key, not a silent second recording).
pub fn fingerprint(body: &str) -> [u8; 32] {
    Sha256::digest(body.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(capacity: usize) -> Arc<IdempotencyKeys> {
        Arc::new(IdempotencyKeys::new(KEY_TTL, capacity, MAX_ANSWER_BYTES))
    }

    fn json(value: serde_json::Value) -> axum::body::Bytes {
        serde_json::to_vec(&value).unwrap().into()
    }

    #[test]
    fn a_recorded_key_replays_and_a_failed_one_is_free_again() {
        let keys = keys(10);
        let Ok(Claim::Fresh(ticket)) = keys.claim("a", [1; 32]) else {
            panic!("fresh")
        };
        assert!(matches!(keys.claim("a", [1; 32]), Ok(Claim::Wait(_))));
        assert!(keys.claim("a", [2; 32]).is_err());
        ticket.succeed(json(serde_json::json!({"recorded": 1})));
        let Ok(Claim::Replay(body)) = keys.claim("a", [1; 32]) else {
            panic!("replay")
        };
        assert_eq!(&body[..], br#"{"recorded":1}"#);
        let Ok(Claim::Fresh(ticket)) = keys.claim("b", [1; 32]) else {
            panic!("fresh")
        };
        drop(ticket);
        assert!(matches!(keys.claim("b", [1; 32]), Ok(Claim::Fresh(_))));
    }

    #[test]
    fn the_oldest_keys_are_forgotten_beyond_the_capacity() {
        let keys = keys(2);
        for key in ["a", "b", "c"] {
            let Ok(Claim::Fresh(ticket)) = keys.claim(key, [0; 32]) else {
                panic!("fresh")
            };
            ticket.succeed(json(serde_json::json!({})));
        }
        assert!(matches!(keys.claim("c", [0; 32]), Ok(Claim::Replay(_))));
        assert!(matches!(keys.claim("a", [0; 32]), Ok(Claim::Fresh(_))));
    }

    #[test]
    fn the_oldest_answers_are_forgotten_beyond_the_byte_limit() {
        let keys = Arc::new(IdempotencyKeys::new(KEY_TTL, 1000, 2_500));
        for key in ["a", "b", "c"] {
            let Ok(Claim::Fresh(ticket)) = keys.claim(key, [0; 32]) else {
                panic!("fresh")
            };
            ticket.succeed(axum::body::Bytes::from(vec![b' '; 1_000]));
        }
        assert_eq!(keys.lock().bytes, 2_000);
        assert!(matches!(keys.claim("a", [0; 32]), Ok(Claim::Fresh(_))));
        assert!(matches!(keys.claim("c", [0; 32]), Ok(Claim::Replay(_))));
    }

    #[test]
    fn keys_are_visible_ascii() {
        let with = |v: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(HEADER, v.parse().unwrap());
            key(&headers)
        };
        assert_eq!(with("batch-42").unwrap().as_deref(), Some("batch-42"));
        assert!(with("").is_err());
        assert!(with("two words").is_err());
        assert!(with(&"k".repeat(256)).is_err());
        assert_eq!(key(&HeaderMap::new()).unwrap(), None);
    }
}
