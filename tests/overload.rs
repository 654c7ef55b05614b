//! Overload behaviour of the real server (spawned on port 0 with the committed models):
//!
//! - with every permit taken, extra requests are refused at once with 503 and Retry-After,
//!   while the accepted ones succeed;
//! - a graceful shutdown stops taking connections and marks the service not ready, yet
//!   finishes every request it had accepted;
//! - a body that stops halfway is answered 408 after the body timeout, holding no permit.
//!
//! Slow requests are made deterministic by sending a request's head and part of its body over a
//! raw TCP connection: the server has accepted the connection and reads the body (before the
//! request takes a permit) until the test sends the rest or the body timeout passes. (Plain blocking sockets on blocking threads: the
//! crate's tokio has no `io-util` feature.) No test depends on how fast this machine is; the
//! only timing assertions have margins far above the figures they guard.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucast::config::ServeConfig;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

mod common;

use common::{example_job, models_dir, spawn_app_with, test_config as config_with, TestApp};

fn test_config() -> ServeConfig {
    config_with(&models_dir())
}

fn batch_body(items: usize) -> Vec<u8> {
    let job = example_job();
    serde_json::to_vec(&json!({ "items": vec![job; items] })).unwrap()
}

// --- a raw HTTP/1.1 request whose body arrives when the test says so --------------------------

/// A request whose head and the first part of its body have been sent.
struct PartialRequest {
    stream: TcpStream,
    rest: Vec<u8>,
}

fn start_request(port: u16, path: &str, body: &[u8], first: usize) -> PartialRequest {
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).expect("the server accepts a connection");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body[..first]).unwrap();
    stream.flush().unwrap();
    PartialRequest {
        stream,
        rest: body[first..].to_vec(),
    }
}

struct RawResponse {
    status: u16,
    headers: String,
    body: Vec<u8>,
}

/// Reads a whole `connection: close` response. An error here (a reset, or the connection closed
/// before a status line) is what "the request was dropped" looks like to a client.
fn read_response(stream: &mut TcpStream) -> io::Result<RawResponse> {
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("no response head in {} bytes", raw.len()),
            )
        })?;
    let headers = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line: {headers}"),
            )
        })?;
    Ok(RawResponse {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    })
}

impl PartialRequest {
    /// Sends the rest of the body and reads the response, on a blocking thread.
    async fn finish(mut self) -> io::Result<RawResponse> {
        tokio::task::spawn_blocking(move || {
            self.stream.write_all(&self.rest)?;
            read_response(&mut self.stream)
        })
        .await
        .expect("the reader does not panic")
    }

    /// Reads the response without sending the rest of the body.
    async fn response(mut self) -> io::Result<RawResponse> {
        tokio::task::spawn_blocking(move || read_response(&mut self.stream))
            .await
            .expect("the reader does not panic")
    }
}

async fn wait_until(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

// --- the tests -------------------------------------------------------------------------------

/// What 64 concurrent batch requests of 256 items met at a server with 2 permits.
struct Burst {
    app: TestApp,
    client: reqwest::Client,
    url: String,
    body: Arc<Vec<u8>>,
    /// Time to the full response of each accepted (200) and refused (503) request.
    accepted: Vec<Duration>,
    refused: Vec<Duration>,
    /// Requests that got no response at all (a reset or closed connection).
    dropped: Vec<String>,
}

async fn burst_against_two_permits() -> Burst {
    let mut config = test_config();
    config.max_concurrent_requests = 2;
    let app = spawn_app_with(config).await;
    let body = Arc::new(batch_body(256));
    let client = reqwest::Client::new();
    let url = format!("{}/v1/estimate/batch", app.address);

    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let response = client
                .post(&url)
                .header("content-type", "application/json")
                .body(body.to_vec())
                .send()
                .await
                .map_err(|e| format!("request failed without a response: {e:?}"))?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let answer: Value = response
                .json()
                .await
                .map_err(|e| format!("unreadable body: {e:?}"))?;
            Ok::<_, String>((status, retry_after, answer, started.elapsed()))
        }));
    }
    let (mut accepted, mut refused, mut dropped) = (Vec::new(), Vec::new(), Vec::new());
    for task in tasks {
        let (status, retry_after, answer, elapsed) = match task.await.unwrap() {
            Ok(outcome) => outcome,
            Err(error) => {
                dropped.push(error);
                continue;
            }
        };
        match status {
            200 => {
                let items = answer["items"].as_array().expect("a batch answer");
                assert_eq!(items.len(), 256);
                assert!(
                    items.iter().all(|i| i["status"] == 200),
                    "every item of an accepted batch succeeds"
                );
                accepted.push(elapsed);
            }
            503 => {
                assert_eq!(
                    retry_after.as_deref(),
                    Some("1"),
                    "a refusal says when to retry"
                );
                assert_eq!(answer["title"], "Overloaded", "{answer}");
                refused.push(elapsed);
            }
            other => panic!("unexpected status {other}: {answer}"),
        }
    }
    eprintln!(
        "{} accepted, {} refused, {} dropped: {:?}",
        accepted.len(),
        refused.len(),
        dropped.len(),
        dropped.first()
    );
    Burst {
        app,
        client,
        url,
        body,
        accepted,
        refused,
        dropped,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_beyond_the_concurrency_limit_are_refused_at_once_with_503_and_retry_after() {
    let Burst {
        app,
        client,
        url,
        body,
        accepted,
        refused,
        ..
    } = burst_against_two_permits().await;
    assert!(!accepted.is_empty(), "some requests are accepted");
    assert!(
        !refused.is_empty(),
        "with 2 permits and 64 concurrent requests some are refused"
    );
    let (accepted_median, refused_median) = (median(accepted), median(refused));
    eprintln!("median time: accepted {accepted_median:?}, refused {refused_median:?}");
    // A refusal does no work: it answers well before an accepted batch of 256 does (4-20 times
    // sooner on a 2-core machine, most of it the 64 clients' own uploads).
    assert!(
        refused_median < accepted_median,
        "refused median {refused_median:?} vs accepted {accepted_median:?}"
    );

    // Every permit came back: the service serves normally once the burst is over.
    wait_until("every permit is released", Duration::from_secs(5), || {
        app.state.permits.available_permits() == 2
    })
    .await;
    let response = client
        .post(&url)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// A refused client must see the 503 and its Retry-After, not a reset connection. A guard that
/// answered 503 without reading the request body let hyper close the connection with request
/// bytes unread; the kernel reset it, and 1 to 12 of the 62 refused clients saw
/// `IncompleteMessage` instead of the answer. The guard now reads the refused body (bounded by
/// the body limit and a 1 s timeout) before answering; this test keeps it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_requests_are_answered_not_reset() {
    let burst = burst_against_two_permits().await;
    assert!(
        burst.dropped.is_empty(),
        "{} of 64 requests got no response at all: {:?}",
        burst.dropped.len(),
        burst.dropped.first()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_shutdown_finishes_every_accepted_request_and_reports_not_ready() {
    const IN_FLIGHT: usize = 8;
    let mut config = test_config();
    // The bodies wait through the shutdown's start; on a loaded machine that can take seconds.
    config.body_read_timeout_secs = 60;
    let mut app = spawn_app_with(config).await;
    let ready: Value = reqwest::get(format!("{}/readyz", app.address))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["ready"], true);

    // IN_FLIGHT batch requests, each accepted and waiting for the rest of its body.
    let body = batch_body(256);
    let mut requests = Vec::new();
    for _ in 0..IN_FLIGHT {
        requests.push(start_request(
            app.port,
            "/v1/estimate/batch",
            &body,
            body.len() / 2,
        ));
    }
    // Their bodies are read before they take a permit, so nothing the server holds says they
    // have arrived: give the connections a moment (far below the body timeout).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let state = app.state.clone();
    app.shutdown.take().unwrap().send(()).unwrap();
    wait_until(
        "the service reports not ready",
        Duration::from_secs(5),
        || !state.ready.load(Ordering::Acquire),
    )
    .await;
    // No new connection is taken once the shutdown has begun.
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", app.port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the listener still accepts connections during shutdown"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !app.server.is_finished(),
        "the server waits for the requests in flight"
    );

    // The accepted requests now send the rest of their bodies and are all answered in full.
    let answers: Vec<_> = join_all(requests.into_iter().map(|r| tokio::spawn(r.finish()))).await;
    for (i, answer) in answers.into_iter().enumerate() {
        let response =
            answer.unwrap_or_else(|e| panic!("request {i} was dropped during shutdown: {e}"));
        assert_eq!(
            response.status,
            200,
            "request {i}: {}",
            String::from_utf8_lossy(&response.body)
        );
        let batch: Value = serde_json::from_slice(&response.body).expect("a complete JSON body");
        assert_eq!(batch["items"].as_array().unwrap().len(), 256);
    }
    let finished = tokio::time::timeout(Duration::from_secs(10), app.server).await;
    finished
        .expect("the server stops once the requests in flight are answered")
        .unwrap()
        .unwrap();
}

/// A body that stops halfway is answered 408 once the body timeout passes, and the request
/// never takes a permit (the body is read first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_halfway_is_answered_408_without_taking_a_permit() {
    let mut config = test_config();
    config.body_read_timeout_secs = 1;
    let app = spawn_app_with(config).await;
    let body = serde_json::to_vec(&example_job()).unwrap();

    let started = Instant::now();
    let request = start_request(app.port, "/v1/estimate", &body, body.len() / 2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(app.state.permits.available_permits(), 512);
    let response = tokio::time::timeout(Duration::from_secs(10), request.response())
        .await
        .expect("answered within 10 s")
        .expect("a response, not a reset");
    let elapsed = started.elapsed();
    assert_eq!(
        response.status,
        408,
        "{}",
        String::from_utf8_lossy(&response.body)
    );
    assert!(
        response.headers.contains("application/problem+json"),
        "{}",
        response.headers
    );
    let problem: Value = serde_json::from_slice(&response.body).unwrap();
    assert_eq!(problem["title"], "Request timeout");
    assert!(
        elapsed >= Duration::from_millis(500),
        "the timeout is 1 s, answered after {elapsed:?}"
    );
}

/// Awaits spawned tasks in order (the crate has no `futures` dependency).
async fn join_all<T>(tasks: impl Iterator<Item = JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("the task does not panic"));
    }
    out
}
