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
    // Room for a declared length is made once its first bytes arrive (allocated, not yet
    // touched, for a body that stalls there): growing by doubling would copy a large body
    // several times and leave the allocator holding the freed steps.
    let declared = axum::body::HttpBody::size_hint(&body)
        .exact()
        .map(|length| usize::try_from(length).unwrap_or(usize::MAX).min(limit));
    let mut bytes: Vec<u8> = Vec::new();
    let mut held: Option<OwnedSemaphorePermit> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| ApiError::UnreadableBody(error.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry no body bytes
        };
        if bytes.len() + data.len() > limit {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        if bytes.is_empty() {
            bytes.reserve_exact(declared.unwrap_or(0).max(data.len()));
        }
        bytes.extend_from_slice(&data);
        let wanted = permits_for(bytes.len());
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
    Ok(ReadBody {
        bytes: Bytes::from(bytes),
        _held: held,
    })
}

/// The permits a body of `len` bytes holds.
fn permits_for(len: usize) -> usize {
    len.saturating_sub(FREE_BYTES_PER_BODY)
        .div_ceil(BYTES_PER_PERMIT)
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
