//! Summary text (torchsummary/torchinfo tables, annotated module prints) -> layers.
#![no_main]

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::summary(data));
