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
    // The bytes as they arrive ([`Segments`]): large frames kept, small ones coalesced (a
    // one-byte chunk kept as a frame would cost a 32-byte entry and pin hyper's read
    // buffer). Nothing is reserved for bytes that have not come (a body that declares 2 MiB
    // and stalls holds what it sent), and the charge is the memory really held.
    // Declared first, dropped last: after the segments it releases.
    let mut unfinished = ReleaseIfUnfinished(true, 0);
    let mut segments = Segments::default();
    let mut held: Option<OwnedSemaphorePermit> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| ApiError::UnreadableBody(error.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry no body bytes
        };
        if segments.len + data.len() > limit {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        // Charged before the segments grow: a body the budget has no room for never holds
        // the larger buffer, even for a moment.
        let wanted = permits_for(segments.held_after(data.len()));
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
        segments.push(data);
        unfinished.1 = segments.held();
    }
    unfinished.0 = false;
    let bytes = segments.join();
    Ok(ReadBody { bytes, _held: held })
}

/// A frame at least this long is kept as it came (a slice of hyper's read buffer: no copy);
/// shorter ones are copied together into segments.
const KEPT_FRAME_BYTES: usize = 4 * 1024;

/// Most bytes of one segment of copied small frames.
const SEGMENT_BYTES: usize = 64 * 1024;

/// What an entry in the list of parts costs beside its bytes.
const PART_OVERHEAD_BYTES: usize = std::mem::size_of::<Bytes>();

/// A body's bytes as held while it arrives: large frames as they came, small ones coalesced
/// into a segment that doubles from 1 KiB to [`SEGMENT_BYTES`], so a one-byte chunk costs a
/// byte, not an entry and the read buffer it would pin.
#[derive(Default)]
struct Segments {
    parts: Vec<Bytes>,
    small: Vec<u8>,
    len: usize,
    /// The bytes of `parts` with their entries' overhead.
    parts_held: usize,
}

impl Segments {
    /// The memory held: the parts, their entries, the small segment's capacity.
    fn held(&self) -> usize {
        self.parts_held + self.small.capacity()
    }

    /// What [`Segments::held`] becomes once a frame of `more` bytes is pushed.
    fn held_after(&self, more: usize) -> usize {
        if more >= KEPT_FRAME_BYTES {
            // The small segment (if any) flushed as a part, the frame kept as one.
            let flushed = usize::from(!self.small.is_empty()) * PART_OVERHEAD_BYTES;
            return self.held() + flushed + more + PART_OVERHEAD_BYTES;
        }
        let room = self.small.capacity() - self.small.len();
        if more <= room {
            return self.held();
        }
        if self.small.len() + more <= SEGMENT_BYTES {
            return self.parts_held + self.grown(more);
        }
        // The segment flushed as a part, a new one started.
        self.held() + PART_OVERHEAD_BYTES + more.max(1024)
    }

    /// The small segment's capacity grown for `more` bytes: doubling, within a segment.
    fn grown(&self, more: usize) -> usize {
        (self.small.len() + more)
            .max(self.small.capacity() * 2)
            .clamp(1024, SEGMENT_BYTES)
    }

    fn flush(&mut self) {
        if !self.small.is_empty() {
            let small = std::mem::take(&mut self.small);
            self.parts_held += small.capacity() + PART_OVERHEAD_BYTES;
            self.parts.push(Bytes::from(small));
        }
    }

    fn push(&mut self, data: Bytes) {
        self.len += data.len();
        if data.len() >= KEPT_FRAME_BYTES {
            self.flush();
            self.parts_held += data.len() + PART_OVERHEAD_BYTES;
            self.parts.push(data);
            return;
        }
        let room = self.small.capacity() - self.small.len();
        if data.len() > room {
            if self.small.len() + data.len() <= SEGMENT_BYTES {
                let grown = self.grown(data.len());
                self.small.reserve_exact(grown - self.small.len());
            } else {
                self.flush();
                self.small = Vec::with_capacity(data.len().max(1024));
            }
        }
        self.small.extend_from_slice(&data);
    }

    /// The body in one buffer, copied once (a frame is a slice of hyper's read buffer, which
    /// hyper cannot reuse while the request holds it); a lone small segment as it is.
    fn join(mut self) -> Bytes {
        if self.parts.is_empty() {
            return Bytes::from(self.small);
        }
        let mut joined = Vec::with_capacity(self.len);
        for part in self.parts.drain(..) {
            joined.extend_from_slice(&part);
        }
        joined.extend_from_slice(&self.small);
        Bytes::from(joined)
    }
}

/// A body read that ends without its bytes (refused, too large, timed out: the future
/// dropped) after it held more than its free share: its buffer, freed on this thread, are
/// handed back to the system, or a flood of large bodies would leave the process larger.
struct ReleaseIfUnfinished(bool, usize);

impl Drop for ReleaseIfUnfinished {
    fn drop(&mut self) {
        if self.0 && self.1 > FREE_BYTES_PER_BODY {
            release_freed_memory();
        }
    }
}

/// The permits a body holding `len` bytes holds.
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
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A body of this many one-byte frames.
    struct Drip(usize);

    impl hyper::body::Body for Drip {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            if self.0 == 0 {
                return Poll::Ready(None);
            }
            self.0 -= 1;
            Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(b"x")))))
        }
    }

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
        // Its bytes past the free share and the entry the frame was kept in.
        assert_eq!(budget.available_permits(), 89);
        drop(read);
        assert_eq!(budget.available_permits(), 100);
    }

    #[tokio::test]
    async fn one_byte_chunks_are_held_as_their_bytes_and_charged_for_the_buffer() {
        // 70,000 one-byte frames: past the free share by their bytes, not by 70,000 entries.
        let budget = Arc::new(Semaphore::new(1000));
        let read = read_within(Body::new(Drip(70_000)), 1 << 20, &budget)
            .await
            .unwrap();
        assert_eq!(read.bytes.len(), 70_000);
        let charged = 1000 - budget.available_permits();
        // A full 64 KiB segment and the next one: charged for their capacity, the memory
        // held, not only the 70,000 bytes.
        assert_eq!(
            charged,
            permits_for(SEGMENT_BYTES + PART_OVERHEAD_BYTES + 8 * 1024),
            "{charged}"
        );
        drop(read);
        assert_eq!(budget.available_permits(), 1000);
    }

    #[test]
    fn small_frames_are_coalesced_large_ones_kept_and_the_charge_is_foreseen() {
        let mut segments = Segments::default();
        let frames: Vec<Bytes> = [1, 1500, 1500, 3 * SEGMENT_BYTES, 7, 4095]
            .iter()
            .cycle()
            .take(120)
            .enumerate()
            .map(|(i, &n)| Bytes::from(vec![i as u8; n]))
            .collect();
        for frame in &frames {
            let expected = segments.held_after(frame.len());
            segments.push(frame.clone());
            assert_eq!(segments.held(), expected);
        }
        let len: usize = frames.iter().map(Bytes::len).sum();
        assert_eq!(segments.len, len);
        // The kept frames and at most a segment's slack, with the entries' overhead.
        assert!(segments.held() < len + 2 * SEGMENT_BYTES + 60 * PART_OVERHEAD_BYTES);
        let joined = segments.join();
        let expected: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
        assert_eq!(&joined[..], &expected[..]);
        // 70,000 one-byte frames: one segment of 64 KiB and a second started.
        let mut drip = Segments::default();
        for _ in 0..70_000 {
            drip.push(Bytes::from_static(b"x"));
        }
        assert_eq!(drip.parts.len(), 1);
        assert_eq!(drip.held(), SEGMENT_BYTES + PART_OVERHEAD_BYTES + 8 * 1024);
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
