//! Answers kept for reuse, by the request's bytes. A scheduler asks again about every job it
//! has not placed yet at each scheduling cycle, and the admission webhook, the scheduler and
//! dashboards ask about the same jobs: a body answered before is answered again from here, in
//! microseconds, on the async worker. An answer is reused only while the calibration profiles
//! it read are current (any observation recorded since makes it stale), and never for a job on
//! an attached card (its driver may come to report another card). Bounded in bytes
//! (`--answer-memo-mib`); off at 0.

use std::sync::Arc;

use quick_cache::sync::Cache;
use quick_cache::Weighter;

use crate::api::types::EstimateResponse;
use crate::calibration::store::{ProfileSnapshot, ProfileVersion};

/// The largest body whose answer is kept: config and layer-list jobs are well under it; a
/// printout or a traced simulation above it is answered each time.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What a kept answer holds beyond its body: the service's resident memory grew by 7 to 10 KiB
/// per answer kept, over 600 to 4,800 distinct MLP jobs (their JSON is 2.5 KB).
const ANSWER_BYTES: u64 = 10 * 1024;

/// Estimate answers by the bytes of the body they answered.
pub type AnswerMemo = Memo<EstimateResponse>;

/// Answers by the bytes of the body they answered ([`Memo::get`], [`Memo::keep`]).
pub struct Memo<A> {
    cache: Option<Bodies<A>>,
}

/// Kept answers by their body's bytes, weighed in bytes.
type Bodies<A> = Cache<Box<[u8]>, Arc<Kept<A>>, ByBytes>;

/// One kept answer and the profiles' version it read.
struct Kept<A> {
    version: ProfileVersion,
    answer: A,
    weight: u64,
}

/// Weighs an entry by its bytes: body and answer.
#[derive(Clone)]
struct ByBytes;

impl<A> Weighter<Box<[u8]>, Arc<Kept<A>>> for ByBytes {
    fn weight(&self, _body: &Box<[u8]>, kept: &Arc<Kept<A>>) -> u64 {
        kept.weight
    }
}

impl<A: Clone> Memo<A> {
    /// Keeps no answer (the CLI: one process, one answer).
    pub const OFF: Memo<A> = Memo { cache: None };

    /// A memo of at most `capacity_bytes` of bodies and answers; [`Memo::OFF`] at 0.
    pub fn new(capacity_bytes: u64) -> Memo<A> {
        if capacity_bytes == 0 {
            return Memo::OFF;
        }
        let entries = (capacity_bytes / ANSWER_BYTES).max(1) as usize;
        Memo {
            cache: Some(Cache::with_weighter(entries, capacity_bytes, ByBytes)),
        }
    }

    /// The answer kept for `body`, when the profiles it read are still `profiles`' version.
    pub fn get(&self, body: &[u8], profiles: &ProfileSnapshot) -> Option<A> {
        let cache = self.cache.as_ref()?;
        if body.len() > MAX_BODY_BYTES {
            return None;
        }
        let kept = cache.get(body)?;
        kept.version.is(profiles).then(|| kept.answer.clone())
    }

    /// Keeps `answer` to `body`, computed from the profiles at `version` (taken before the
    /// answer read them: a version read later is newer, and makes the answer stale at once).
    pub fn keep(&self, body: &[u8], version: ProfileVersion, answer: &A) {
        let Some(cache) = self.cache.as_ref() else {
            return;
        };
        if body.len() > MAX_BODY_BYTES {
            return;
        }
        let weight = body.len() as u64 + ANSWER_BYTES;
        let kept = Kept {
            version,
            answer: answer.clone(),
            weight,
        };
        cache.insert(body.into(), Arc::new(kept));
    }

    /// Answers kept now.
    pub fn len(&self) -> usize {
        self.cache.as_ref().map_or(0, Cache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::store::ProfileStore;

    fn store() -> (ProfileStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = ProfileStore::load(dir.path()).unwrap();
        (store, dir)
    }

    #[test]
    fn an_answer_is_reused_while_its_profiles_are_current() {
        let (store, _dir) = store();
        let memo: Memo<String> = Memo::new(1 << 20);
        let before = store.snapshot();
        memo.keep(b"{\"job\": 1}", before.version(), &"answer".to_string());
        assert_eq!(
            memo.get(b"{\"job\": 1}", &store.snapshot()).as_deref(),
            Some("answer")
        );
        assert_eq!(
            memo.get(b"{\"job\":1}", &store.snapshot()),
            None,
            "other bytes"
        );
        store.observe("h100-80gb", 2000.0, 2100.0).unwrap();
        assert_eq!(
            memo.get(b"{\"job\": 1}", &store.snapshot()),
            None,
            "the profiles moved"
        );
        // A snapshot taken before still reads the old version: what it answered stays valid
        // for it, and for nobody else.
        assert_eq!(
            memo.get(b"{\"job\": 1}", &before).as_deref(),
            Some("answer")
        );
    }

    #[test]
    fn the_memo_holds_its_bytes_and_no_large_body() {
        let (store, _dir) = store();
        let capacity = 16 * ANSWER_BYTES;
        let memo: Memo<u64> = Memo::new(capacity);
        let version = store.snapshot().version();
        for job in 0..1000u64 {
            memo.keep(job.to_string().as_bytes(), version.clone(), &job);
        }
        assert!(memo.len() <= 16, "{} kept", memo.len());
        assert!(!memo.is_empty());
        let large = vec![b' '; MAX_BODY_BYTES + 1];
        memo.keep(&large, version, &1);
        assert_eq!(memo.get(&large, &store.snapshot()), None);
        let off: Memo<u64> = Memo::new(0);
        off.keep(b"{}", store.snapshot().version(), &1);
        assert!(off.is_empty());
    }
}
