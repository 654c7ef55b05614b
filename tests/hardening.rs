//! Attacks a single caller could mount on loopback (issue: hardening), each against the real
//! server on an ephemeral port, bounded in count and time: odd HTTP methods in the metrics,
//! oversized and slow bodies, every request slot taken, half-sent headers, shutdown with a
//! half-sent header. Raw sockets on blocking threads (the crate's tokio has no `io-util`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;

use common::{example_job, models_dir, spawn_app_with, test_config, TestApp};
use gpucast::config::ServeConfig;

fn config() -> ServeConfig {
    test_config(&models_dir())
}

/// Sends `head` (and nothing else) and returns the open stream.
fn send(port: u16, head: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(head).unwrap();
    stream
}

/// The response's status line and how long it took, or `None` if the server closed the
/// connection (or sent nothing) within `limit`.
fn status_within(stream: &mut TcpStream, limit: Duration) -> (Option<u16>, Duration) {
    let started = Instant::now();
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buffer = [0u8; 256];
    let read = stream.read(&mut buffer).unwrap_or(0);
    let text = String::from_utf8_lossy(&buffer[..read]);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    (status, started.elapsed())
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metrics_label_value_comes_from_a_fixed_set() {
    let app = spawn_app_with(config()).await;
    let port = app.port;
    blocking(move || {
        for i in 0..20 {
            let mut stream = send(
                port,
                format!("ODD{i}METHOD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            );
            let _ = status_within(&mut stream, Duration::from_secs(5));
        }
    })
    .await;
    let metrics = app.get("/metrics").await.text().await.unwrap();
    assert!(!metrics.contains("ODD"), "raw methods in the labels");
    assert!(metrics.contains("method=\"other\""), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_content_length_is_refused_at_once_with_413() {
    let app = spawn_app_with(config()).await;
    let port = app.port;
    let (status, took) = blocking(move || {
        let mut stream = send(
            port,
            b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n",
        );
        status_within(&mut stream, Duration::from_secs(8))
    })
    .await;
    assert_eq!(status, Some(413));
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

/// Every permit taken by the test itself: the probes and the metrics still answer at once,
/// readiness says the service cannot take estimates (so a balancer sends them elsewhere), and
/// liveness that it lives (so nothing restarts it for being busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_metrics_answer_with_every_request_slot_taken() {
    let mut config = config();
    config.max_concurrent_requests = 4;
    let app = spawn_app_with(config).await;
    let _held = app
        .state
        .permits
        .clone()
        .acquire_many_owned(4)
        .await
        .unwrap();
    for path in ["/healthz", "/metrics"] {
        assert_eq!(app.get(path).await.status(), 200, "{path}");
    }
    assert_eq!(app.get("/readyz").await.status(), 503);
    let refused = app.post_json("/v1/estimate", &example_job()).await;
    assert_eq!(refused.status(), 503);
    drop(_held);
    assert_eq!(app.get("/readyz").await.status(), 200, "ready again");
}

/// More slow bodies than request slots: they wait for their bodies without holding a slot, and
/// are answered 408 when the body does not come in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_hold_no_request_slot_and_time_out_with_408() {
    let mut config = config();
    config.max_concurrent_requests = 4;
    config.body_read_timeout_secs = 2;
    let app = spawn_app_with(config).await;
    let port = app.port;
    let mut slow: Vec<TcpStream> = blocking(move || {
        (0..12)
            .map(|_| {
                send(
                    port,
                    b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"batch_size\": 1",
                )
            })
            .collect()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(app.get("/healthz").await.status(), 200);
    let answered = app.post_json("/v1/estimate", &example_job()).await;
    assert_eq!(
        answered.status(),
        200,
        "a legitimate estimate while 12 bodies trickle"
    );
    let statuses = blocking(move || {
        slow.iter_mut()
            .map(|s| status_within(s, Duration::from_secs(8)).0)
            .collect::<Vec<_>>()
    })
    .await;
    assert!(statuses.iter().all(|s| *s == Some(408)), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_header_is_closed_after_the_header_timeout() {
    let mut config = config();
    config.header_read_timeout_secs = 1;
    let app = spawn_app_with(config).await;
    let port = app.port;
    let (status, took) = blocking(move || {
        let mut stream = send(port, b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\n");
        status_within(&mut stream, Duration::from_secs(10))
    })
    .await;
    assert!(status.is_none() || status == Some(408), "{status:?}");
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
}

/// Shutdown with a connection that never finishes its header: the drain is bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_within_the_drain_bound_despite_a_half_sent_header() {
    let mut config = config();
    config.header_read_timeout_secs = 60;
    config.drain_timeout_secs = 2;
    let mut app: TestApp = spawn_app_with(config).await;
    let port = app.port;
    let _stuck = blocking(move || send(port, b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\n")).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    app.shutdown.take().unwrap().send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), app.server).await;
    assert!(ended.is_ok(), "the server did not stop within 10 s");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoded_body_is_refused_with_415() {
    let app = spawn_app_with(config()).await;
    let response = app
        .client
        .post(format!("{}/v1/estimate", app.address))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 0x08, 0x00])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_given_as_an_array_is_refused() {
    let app = spawn_app_with(config()).await;
    let body = serde_json::json!({"batch_size": 8, "layers": [["linear", 10, 110]]});
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 422);
    let problem: serde_json::Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().starts_with("layers"),
        "{problem}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_value_is_echoed_back_truncated() {
    let app = spawn_app_with(config()).await;
    let mut body = example_job();
    body["family"] = serde_json::Value::String("z".repeat(10_000));
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 422);
    let detail = response.json::<serde_json::Value>().await.unwrap()["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(detail.len() < 300, "{} bytes echoed", detail.len());
}

/// The right to write is checked before the body is parsed: garbage from a caller without the
/// token is a 401, not a 400 that parsed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_checked_before_the_body_is_parsed() {
    let mut config = config();
    config.token = Some(gpucast::config::ApiToken::new("s3cret"));
    let app = spawn_app_with(config).await;
    for path in ["/v1/calibration/observations", "/v1/calibration/watch"] {
        let response = app.post_raw(path, "application/json", "{not json").await;
        assert_eq!(response.status(), 401, "{path}");
    }
}

/// Two values for one key: refused, not the last one silently kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observation_with_a_duplicate_key_is_refused() {
    let app = spawn_app_with(config()).await;
    let job = serde_json::to_string(&example_job()).unwrap();
    for body in [
        format!(
            r#"{{"gpu": "a100-40gb", "observed_peak_mib": 3000, "observed_peak_mib": 5, "job": {job}}}"#
        ),
        format!(
            r#"[{{"gpu": "a100-40gb", "gpu": "t4", "observed_peak_mib": 3000, "job": {job}}}]"#
        ),
    ] {
        let response = app
            .post_raw("/v1/calibration/observations", "application/json", body)
            .await;
        let status = response.status();
        let problem: serde_json::Value = response.json().await.unwrap();
        assert_eq!(status, 422, "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("duplicate"),
            "{problem}"
        );
    }
    let profiles: serde_json::Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(
        profiles["profiles"],
        serde_json::json!([]),
        "nothing recorded"
    );
}

/// The roofline's cost follows a job's layers, never its parameter count: a 185-byte print of
/// 4095 layers of 9 x 10^12 parameters each (a foreach optimizer step of 10^10 launches) used to
/// hold a blocking thread for minutes. Four of them, on every card at once, must leave the
/// service answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_of_absurd_parameter_count_costs_no_more_than_its_layers() {
    let app = spawn_app_with(config()).await;
    let text =
        "Net(\n  (0-4094): 4095 x Linear(in_features=3000000, out_features=3000000, bias=True)\n)";
    let bomb = serde_json::json!({
        "summary": {"format": "module_print", "text": text},
        "batch_size": 8,
        "gpu": ["a100-40gb", "h100-80gb", "t4", "l4"],
    });
    let started = Instant::now();
    let (a, b, c, d) = tokio::join!(
        app.post_json("/v1/estimate", &bomb),
        app.post_json("/v1/estimate", &bomb),
        app.post_json("/v1/estimate", &bomb),
        app.post_json("/v1/estimate", &bomb),
    );
    for response in [a, b, c, d] {
        assert!(
            response.status() == 200 || response.status() == 422,
            "{}",
            response.status()
        );
    }
    let ordinary = app.post_json("/v1/estimate", &example_job()).await;
    assert_eq!(ordinary.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// What a web page can make its visitor's browser send to a loopback listener: a post without
/// a JSON content type (a "simple" request, no preflight), one from another origin, one with
/// cross-site fetch metadata, and one through DNS rebinding (a foreign Host). Each is refused
/// before its body is read, and nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_shaped_writes_are_refused_on_loopback() {
    let app = spawn_app_with(config()).await;
    let body = serde_json::json!({"gpu": "a100-40gb", "observed_peak_mib": 3000.0,
                                  "job": example_job()})
    .to_string();
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{}/v1/calibration/observations", app.port);
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let other_port = format!("http://localhost:{}", app.port.wrapping_add(1));
    let cases: [(&str, Headers, u16); 6] = [
        ("no content type", &[], 415),
        ("a form", &[("content-type", "text/plain")], 415),
        (
            "another origin",
            &[
                ("content-type", "application/json"),
                ("origin", "http://evil.example"),
            ],
            403,
        ),
        (
            "another port of this host",
            &[
                ("content-type", "application/json"),
                ("origin", other_port.as_str()),
            ],
            403,
        ),
        (
            "cross-site metadata",
            &[
                ("content-type", "application/json"),
                ("sec-fetch-site", "cross-site"),
            ],
            403,
        ),
        (
            "a rebound host",
            &[
                ("content-type", "application/json"),
                ("host", "evil.example:8080"),
            ],
            403,
        ),
    ];
    for (case, headers, status) in cases {
        let mut request = client.post(&url).body(body.clone());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status, "{case}");
    }
    let profiles: serde_json::Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(
        profiles["profiles"],
        serde_json::json!([]),
        "nothing recorded"
    );
    // The same post from the local origin is taken.
    let response = client
        .post(&url)
        .header("content-type", "application/json")
        .header("origin", format!("http://localhost:{}", app.port))
        .header("sec-fetch-site", "same-origin")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// Bodies are charged for the bytes they sent, as they arrive: with room for one 2 MiB body,
/// 40 trickling bodies (half declaring 2 MiB, half chunked, each a few bytes sent) take none
/// of it, and a large batch still answers. Two bodies that did send most of the budget leave
/// too little for a large one, refused at once, while small ones (a single estimate), the
/// probes and bodiless requests still answer; their room comes back when they are answered 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_flight_hold_only_the_bytes_they_sent() {
    let mut config = config();
    config.max_body_bytes_in_flight = config.max_body_bytes;
    config.body_read_timeout_secs = 3;
    let budget = config.max_body_bytes_in_flight;
    let app = spawn_app_with(config).await;
    let port = app.port;
    let large = serde_json::json!({"items": vec![example_job(); 250]});
    let large_bytes = serde_json::to_vec(&large).unwrap().len();
    assert!(large_bytes > 128 * 1024, "{large_bytes}");

    let trickles = blocking(move || {
        (0..40)
            .map(|i| {
                let head: &[u8] = if i % 2 == 0 {
                    b"POST /v1/estimate/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2097152\r\n\r\n{\"items\""
                } else {
                    b"POST /v1/estimate/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
                };
                send(port, head)
            })
            .collect::<Vec<_>>()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answered = app.post_json("/v1/estimate/batch", &large).await;
    assert_eq!(
        answered.status(),
        200,
        "trickles hold nothing they did not send"
    );

    // Two bodies send all but half of what the large batch would take of the budget.
    let held = budget - (large_bytes - 64 * 1024) / 2;
    let sent = held / 2 + 64 * 1024;
    let fill = move || {
        let head = format!(
            "POST /v1/estimate/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {budget}\r\n\r\n"
        );
        let mut stream = send(port, head.as_bytes());
        stream.write_all(&vec![b' '; sent]).unwrap();
        stream
    };
    let mut filling = [blocking(fill).await, blocking(fill).await];
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = app.post_json("/v1/estimate/batch", &large).await;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    let small = app.post_json("/v1/estimate", &example_job()).await;
    assert_eq!(small.status(), 200, "a single estimate is not refused");
    assert_eq!(app.get("/healthz").await.status(), 200);
    assert_eq!(app.get("/v1/gpus").await.status(), 200);
    let statuses = blocking(move || {
        filling
            .iter_mut()
            .map(|stream| status_within(stream, Duration::from_secs(8)).0)
            .collect::<Vec<_>>()
    })
    .await;
    assert_eq!(statuses, [Some(408), Some(408)]);
    let answered = app.post_json("/v1/estimate/batch", &large).await;
    assert_eq!(answered.status(), 200, "the budget is back");
    drop(trickles);
}

/// Past --max-connections a new connection is closed at once, and one closing makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_at_once() {
    let mut config = config();
    config.max_connections = 3;
    let app = spawn_app_with(config).await;
    let port = app.port;
    let (status, took) = blocking(move || {
        let held: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut extra = send(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        let refused = status_within(&mut extra, Duration::from_secs(3));
        drop(held);
        refused
    })
    .await;
    assert_eq!(status, None, "closed without an answer");
    assert!(took < Duration::from_secs(2), "{took:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(app.get("/healthz").await.status(), 200);
}

/// A connection from `source` (a loopback address: Linux answers all of 127/8) to the
/// server's port on 127.0.0.1, as a blocking std stream.
async fn connect_from(source: [u8; 4], port: u16) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .unwrap();
    let stream = socket
        .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .unwrap();
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
}

/// One address holds at most --max-connections-per-address: its connections past that are
/// closed at once, and another address is still answered although the first tried to take
/// every connection of the port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_the_connections_of_another() {
    let mut config = config();
    config.max_connections = 8;
    config.max_connections_per_address = 4;
    let app = spawn_app_with(config).await;
    let port = app.port;
    let mut held = Vec::new();
    for _ in 0..12 {
        held.push(connect_from([127, 0, 0, 2], port).await);
    }
    let (open, other) = blocking(move || {
        std::thread::sleep(Duration::from_millis(300));
        // The ones past the address's cap were closed without an answer.
        let open = held
            .iter()
            .filter(|stream| {
                let mut reader: &TcpStream = stream;
                reader
                    .set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let mut byte = [0u8; 1];
                // Still open: nothing to read within the timeout.
                matches!(reader.read(&mut byte), Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ))
            })
            .count();
        let mut other = send(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        let answered = status_within(&mut other, Duration::from_secs(2));
        drop(held);
        (open, answered)
    })
    .await;
    assert_eq!(open, 4, "the address keeps its cap's worth");
    assert_eq!(other.0, Some(200), "another address is answered");
    assert!(other.1 < Duration::from_secs(2), "{:?}", other.1);
}

/// The health listener (`--health-listen`) answers /healthz and /readyz while the main port
/// has every connection taken and closes new ones at once (`/readyz` then says not ready:
/// the port refuses connections); it answers nothing else, and it says not ready once the
/// service is shutting down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_listener_answers_while_the_main_port_is_full() {
    let mut config = config();
    config.max_connections = 3;
    config.health_listen = Some("127.0.0.1:0".parse().unwrap());
    let mut app = spawn_app_with(config).await;
    let port = app.port;
    let health = app.health_port.expect("a health port");
    let (main, healthz, readyz, other) = blocking(move || {
        let held: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let get = |port: u16, path: &str| {
            let mut stream = send(
                port,
                format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
            );
            status_within(&mut stream, Duration::from_secs(3)).0
        };
        let answers = (
            get(port, "/healthz"),
            get(health, "/healthz"),
            get(health, "/readyz"),
            get(health, "/v1/gpus"),
        );
        drop(held);
        answers
    })
    .await;
    assert_eq!(main, None, "the main port is full");
    // Alive, and not ready while the main port refuses connections.
    assert_eq!((healthz, readyz, other), (Some(200), Some(503), Some(404)));
    let readyz = blocking(move || {
        std::thread::sleep(Duration::from_millis(300));
        let mut stream = send(health, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n");
        status_within(&mut stream, Duration::from_secs(3)).0
    })
    .await;
    assert_eq!(readyz, Some(200), "ready again once the connections close");

    app.state
        .ready
        .store(false, std::sync::atomic::Ordering::Release);
    let readyz = blocking(move || {
        let mut stream = send(health, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n");
        status_within(&mut stream, Duration::from_secs(3)).0
    })
    .await;
    assert_eq!(readyz, Some(503));
    let _ = app.shutdown.take().map(|s| s.send(()));
}
