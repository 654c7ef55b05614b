//! Reading a request body within the bytes held over every connection: each body is charged
//! for the bytes that have actually arrived, as they arrive, never for what its header
//! declares. A trickle of headers (a declared 2 MiB, or a chunked body that sends one byte)
//! holds only what it sent, so it cannot deny bodies to anyone else.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// The first bytes of every body take nothing from the shared budget: at most
/// `--max-connections` of them are held at once (1,024 x 64 KiB = 64 MiB by default), so a
/// single estimate is never refused for others' large bodies.
pub const FREE_BYTES_PER_BODY: usize = 64 * 1024;

/// One permit of the budget is this many bytes.
const BYTES_PER_PERMIT: usize = 1024;

/// A body read whole, with what it holds of the shared budget (released when dropped: keep
/// it while the bytes are in use).
pub struct ReadBody {
    pub bytes: Bytes,
    pub _held: Option<OwnedSemaphorePermit>,
}

/// Reads `body` up to `limit` bytes, taking each arriving frame's bytes past
/// [`FREE_BYTES_PER_BODY`] from `budget`. A body past `limit` is a 413; a frame the budget has
/// no room for is a 503 at once, the bytes it had already taken given back.
pub async fn read_within(
    body: Body,
    limit: usize,
    budget: &Arc<Semaphore>,
) -> Result<ReadBody, ApiError> {
    let mut body = body;
    // The frames as they arrive, joined once at the end: no copy while reading, and no
    // memory for bytes that have not come (a body that declares 2 MiB and stalls holds what
    // it sent).
    // Declared first, dropped last: after the frames it releases.
    let mut unfinished = ReleaseIfUnfinished(true, 0);
    let mut frames: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    let mut held: Option<OwnedSemaphorePermit> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| ApiError::UnreadableBody(error.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry no body bytes
        };
        if len + data.len() > limit {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        len += data.len();
        unfinished.1 = len;
        frames.push(data);
        let wanted = permits_for(len);
        let have = held.as_ref().map_or(0, |p| p.num_permits());
        if wanted > have {
            let more = u32::try_from(wanted - have).unwrap_or(u32::MAX);
            let permit = budget
                .clone()
                .try_acquire_many_owned(more)
                .map_err(|_| ApiError::Overloaded)?;
            match held.as_mut() {
                Some(held) => held.merge(permit),
                None => held = Some(permit),
            }
        }
    }
    unfinished.0 = false;
    // Copied out, even a single frame: a frame is a slice of hyper's read buffer, which
    // hyper cannot reuse while the request holds it.
    let mut joined = Vec::with_capacity(len);
    for frame in &frames {
        joined.extend_from_slice(frame);
    }
    drop(frames);
    let bytes = Bytes::from(joined);
    Ok(ReadBody { bytes, _held: held })
}

/// A body read that ends without its bytes (refused, too large, timed out: the future
/// dropped) after it held more than its free share: its frames, freed on this thread, are
/// handed back to the system, or a flood of large bodies would leave the process larger.
struct ReleaseIfUnfinished(bool, usize);

impl Drop for ReleaseIfUnfinished {
    fn drop(&mut self) {
        if self.0 && self.1 > FREE_BYTES_PER_BODY {
            release_freed_memory();
        }
    }
}

/// The permits a body of `len` bytes holds.
fn permits_for(len: usize) -> usize {
    len.saturating_sub(FREE_BYTES_PER_BODY)
        .div_ceil(BYTES_PER_PERMIT)
}

std::thread_local! {
    /// Whether this thread freed memory to hand back once it is idle
    /// ([`release_freed_memory_when_idle`]).
    static RELEASE_DUE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// [`release_freed_memory`] on this thread once it has no more work to do (the estimate
/// pool's threads check, `http::pool`), not now: pages freed between back-to-back batch parts
/// are the next part's, and handing them back had the kernel zero them again on the next
/// part's first touch (under a flood of batches, over half of the server's CPU time).
pub fn release_freed_memory_when_idle() {
    RELEASE_DUE.with(|due| due.set(true));
}

/// Whether this thread has freed memory to hand back once idle.
pub fn release_due() -> bool {
    RELEASE_DUE.with(|due| due.get())
}

/// Hands the heaps' freed pages back to the system, on the calling thread (mimalloc's heaps
/// are per thread): mimalloc (the service's allocator) and glibc's (ONNX Runtime's buffers)
/// keep a batch's megabytes of features and answers, or a large body's frames, and a flood of
/// them would leave the process that much larger for good.
pub fn release_freed_memory() {
    RELEASE_DUE.with(|due| due.set(false));
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory at the top of glibc's heaps and arenas; it
    // touches no memory the program holds.
    unsafe {
        libc::malloc_trim(0);
    }
    // SAFETY: mi_collect frees what mimalloc holds unused; it touches no live allocation.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bytes_past_the_free_share_are_charged() {
        assert_eq!(permits_for(0), 0);
        assert_eq!(permits_for(FREE_BYTES_PER_BODY), 0);
        assert_eq!(permits_for(FREE_BYTES_PER_BODY + 1), 1);
        assert_eq!(permits_for(FREE_BYTES_PER_BODY + 4096), 4);
    }

    #[tokio::test]
    async fn a_body_holds_what_it_read_and_gives_it_back() {
        let budget = Arc::new(Semaphore::new(100));
        let body = Body::from(vec![b'x'; FREE_BYTES_PER_BODY + 10 * 1024]);
        let read = read_within(body, 1 << 20, &budget).await.unwrap();
        assert_eq!(read.bytes.len(), FREE_BYTES_PER_BODY + 10 * 1024);
        assert_eq!(budget.available_permits(), 90);
        drop(read);
        assert_eq!(budget.available_permits(), 100);
    }

    #[tokio::test]
    async fn a_body_past_the_budget_is_refused_and_frees_what_it_took() {
        let budget = Arc::new(Semaphore::new(4));
        let body = Body::from(vec![b'x'; FREE_BYTES_PER_BODY + 8 * 1024]);
        let refused = read_within(body, 1 << 20, &budget).await;
        assert!(matches!(refused, Err(ApiError::Overloaded)));
        assert_eq!(budget.available_permits(), 4);
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_refused() {
        let budget = Arc::new(Semaphore::new(1000));
        let body = Body::from(vec![b'x'; 2048]);
        let refused = read_within(body, 1024, &budget).await;
        assert!(matches!(refused, Err(ApiError::PayloadTooLarge(1024))));
    }
}
