//! The floor an estimate route cannot go below: axum reading a JSON body and writing back a
//! JSON reply of the size the service's answer has, nothing else. `scripts/floor-bench.py` runs
//! it beside the service under the same load and reports the ratios (docs/reports/performance.md).
//!
//!     cargo run --release --example json_floor -- PORT REPLY.json

use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;

/// The service's allocator (src/main.rs): the floor pays for its allocations what the
/// service would, so the ratios compare the work and not the allocators.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let port: u16 = args
        .next()
        .and_then(|p| p.parse().ok())
        .expect("usage: json_floor PORT REPLY.json");
    let reply: Value = serde_json::from_str(
        &std::fs::read_to_string(args.next().expect("usage: json_floor PORT REPLY.json"))
            .expect("the reply file reads"),
    )
    .expect("the reply is JSON");
    // Parse the body and serialise the reply on every request, as the service does.
    let app = Router::new().route(
        "/v1/estimate",
        post(move |Json(_request): Json<Value>| {
            let reply = reply.clone();
            async move { Json(reply) }
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("the port binds");
    axum::serve(listener, app).await.expect("serves");
}
