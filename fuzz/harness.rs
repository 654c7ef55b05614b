//! What each fuzz target does with its input, shared by the libFuzzer targets
//! (`fuzz_targets/*.rs`) and the regression test that replays saved crashes
//! (`tests/fuzz_regressions.rs`), so a crash reproduces exactly the same way in both.
//! Each function must never panic, whatever the bytes.

use gpucast::api::types::EstimateRequest;
use gpucast::parsers::{parse_summary, SampleShape, SummaryFormat};

/// The JSON description path of `POST /v1/estimate`: bytes -> wire type -> validated job
/// (a layer list, or summary text parsed into one).
pub fn estimate_request(data: &[u8]) {
    if let Ok(request) = serde_json::from_slice::<EstimateRequest>(data) {
        let _ = gpucast::engine::validate::to_job(&request);
    }
}

/// Summary text parsing. The first byte selects the format (bits 0-1: auto, torchsummary/torchinfo
/// table, module print or Keras), whether `seq_len` is given (bit 2) and its value (bits 4-7,
/// times 8, plus 1), and whether an image `input_shape` is given (bit 3); the rest is the text,
/// which must be UTF-8 as it is in a JSON string.
pub fn summary(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let format = match selector & 3 {
        0 => SummaryFormat::Auto,
        1 => SummaryFormat::Torchsummary,
        2 => SummaryFormat::ModulePrint,
        _ => SummaryFormat::Keras,
    };
    let sample = SampleShape {
        seq_len: (selector & 4 != 0).then(|| u64::from(selector >> 4) * 8 + 1),
        input_shape: (selector & 8 != 0).then_some(&[3, 32, 32][..]),
    };
    let _ = parse_summary(format, text, 32, sample);
}
