//! bytes -> serde_json::from_slice::<EstimateRequest> -> to_job: the JSON description path.
#![no_main]

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::estimate_request(data));
